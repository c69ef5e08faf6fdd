"""RMS normalisation, computed in float32 like the reference implementations."""

import torch
import torch.nn.functional as F
from torch import nn

from ferrox._native import add_rms_norm_cpu
from ferrox.layers.native import kernel_threads, on_cpu_fp32


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def add_forward(
        self, residual: torch.Tensor | None, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); with no residual yet,
        `delta` starts it. The sum is formed in place in `residual`."""
        if residual is None:
            return self.forward(delta), delta
        if on_cpu_fp32(residual, delta, self.weight) and residual.is_contiguous():
            out = torch.empty_like(residual)
            add_rms_norm_cpu(
                residual.numpy(),
                delta.contiguous().numpy(),
                self.weight.detach().numpy(),
                self.eps,
                out.numpy(),
                kernel_threads(),
            )
            return out, residual
        residual = residual + delta
        return self.forward(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden]
        if on_cpu_fp32(x, self.weight):
            # The native kernel, as `add_forward` and the fused decode run it:
            # one numeric path whatever the step (a different summation could
            # move a block kernel's int8 activation across a rounding step).
            x = x.contiguous()
            out = torch.empty_like(x)
            add_rms_norm_cpu(
                x.numpy(), None, self.weight.detach().numpy(), self.eps, out.numpy(),
                kernel_threads(),
            )  # fmt: skip
            return out
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, the same arithmetic as below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
