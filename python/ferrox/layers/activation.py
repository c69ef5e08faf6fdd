"""Gated activations."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * intermediate] (gate then up) -> [T, intermediate]
    gate, up = x.chunk(2, dim=-1)
    if torch.is_inference_mode_enabled() and not x.requires_grad:
        # `x` is a temporary of the forward pass: activate the gate in place.
        return F.silu(gate, inplace=True).mul_(up)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma): gate then up."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
