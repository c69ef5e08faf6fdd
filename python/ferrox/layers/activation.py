"""Gated activations."""

import torch
import torch.nn.functional as F
from torch import nn

from ferrox._native import gate_rows_cpu
from ferrox.layers.native import kernel_threads
from ferrox.layers.quant_linear import QuantLinear


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


def gated_projection(proj: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a gated MLP's gate_up projection `proj` of `x`
    (`activation`: "silu" or "gelu_tanh"): one native call where `proj` is
    a block-format layer on the CPU kernels (`QuantLinear.gated`), else the
    projection, then the activation (on the CPU in float32, the native one:
    a single pass into contiguous rows, where torch's takes three)."""
    if isinstance(proj, QuantLinear):
        out = proj.gated(x, activation)
        if out is not None:
            return out
    gate_up = proj(x)
    native = gate_up.device.type == "cpu" and gate_up.dtype == torch.float32
    if native and not gate_up.requires_grad:
        rows = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        out = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=torch.float32)
        gate_rows_cpu(out.numpy(), rows.numpy(), activation, kernel_threads())
        return out.view(*gate_up.shape[:-1], out.shape[1])
    return silu_and_mul(gate_up) if activation == "silu" else gelu_tanh_and_mul(gate_up)
