"""Gated activations."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * intermediate] (gate then up) -> [T, intermediate]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
