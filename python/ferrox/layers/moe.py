"""Mixture-of-experts feed-forward blocks: a router picks `top_k` experts
per token, each a gated MLP; a token's output is the routing-weighted sum
of its experts' outputs.

Tokens are grouped by expert (one sort of the flat (token, choice) pairs),
and each expert that any token chose runs once on its tokens: one
gate/up and one down projection per active expert, whatever the batch. The
experts are ordinary linear modules, so every weight form the dense layers
have serves them too: float (packed for oneDNN on the CPU), block formats
kept from a GGUF file or quantized at load (`QuantLinear`'s native kernels),
and under tensor parallelism each rank holds its slice of every expert's
intermediate columns (the block's sum is all-reduced once).

On the CPU, with block-format experts, a step of few tokens (a decode)
runs the block in one native call (`CpuMoeExperts`: `ferrox_cpu::route`,
then `ferrox_cpu::moe_experts`): the router's float32 logits (summed in
another order than torch's, so a near-tie may pick another expert), the
same expert kernels and rounding as the per-expert calls, in two
thread-pool dispatches a layer instead of two per active expert, and
without the per-expert tensor operations. Larger steps
(prefill) take the per-expert path, where each projection picks its
kernel by its row count (`QuantLinear`).

The grouping reads the per-expert counts back to the host, so a step with
MoE layers is not captured in a CUDA graph (the model says so:
`supports_cuda_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from ferrox._native import CpuMoeExperts
from ferrox.common.errors import ModelLoadError
from ferrox.layers import quant_linear
from ferrox.layers.native import kernel_threads
from ferrox.layers.quant_linear import QuantLinear
from ferrox.parallel import state as distributed


class Router(nn.Linear):
    """The expert router's logits (hidden -> experts). A subclass so that
    load-time quantization, which replaces plain `nn.Linear` layers, leaves
    it in float: rounding its weight would move tokens between experts."""


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (in float32), the `top_k` largest per token
    and, with `renormalize`, those rescaled to sum to one: ([T, k] weights in
    the logits' dtype, [T, k] expert ids)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def run_experts(
    x: torch.Tensor,  # [T, hidden]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k]
    experts: nn.ModuleList,
) -> torch.Tensor:  # [T, hidden]
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t, each
    chosen expert run once on all the tokens that chose it."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    tokens = order // top_k
    scale = weights.reshape(-1)[order].unsqueeze(1)  # [T * k, 1]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count:
            rows = slice(start, start + count)
            chosen = tokens[rows]
            out.index_add_(0, chosen, expert(x[chosen]) * scale[rows])
            start += count
    return out


class SparseMoe(nn.Module):
    """Router plus experts (Qwen3-MoE's layout: `gate`, `experts.{e}`).
    `expert` builds one expert at this rank's size (its output not
    all-reduced: the block reduces the sum once). `shared_expert` (Qwen2-MoE,
    Qwen3.5-MoE): an expert every token runs, its output scaled by
    sigmoid(`shared_expert_gate`(x)) and added to the routed experts'."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        expert: Callable[[], nn.Module],
        router_bias: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"{top_k} experts per token out of {num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(hidden_size, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(expert() for _ in range(num_experts))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: Router | None = None
        self.native: CpuMoeExperts | None = None

    def add_shared_expert(self, expert: nn.Module) -> None:
        """An expert every token runs, gated per token by a sigmoid."""
        self.shared_expert = expert
        self.shared_expert_gate = Router(self.gate.in_features, 1, bias=False)

    def prepare_native(self) -> bool:
        """Once the weights are loaded: whether few-token steps run the
        experts in one native call (block-format weights on the CPU, one
        format per projection, biases on all experts or none, a SiLU or
        gpt-oss's clamped SwiGLU gate: the experts' `activation`)."""
        self.native = None
        pairs: list[tuple[QuantLinear, QuantLinear]] = []
        for expert in self.experts:
            gate_up, down = expert.gate_up_proj, expert.down_proj
            if not all(
                isinstance(m, QuantLinear) and m.weight.device.type == "cpu"
                for m in (gate_up, down)
            ):
                return False
            pairs.append((cast(QuantLinear, gate_up), cast(QuantLinear, down)))
        kinds = {
            (g.fmt, d.fmt, g.bias is None, d.bias is None, g.packed, d.packed) for g, d in pairs
        }
        if len(kinds) != 1 or pairs[0][0].packed != pairs[0][1].packed:
            return False
        router = self.gate.weight.detach()
        if router.dtype != torch.float32 or router.device.type != "cpu":
            return False
        first: Any = self.experts[0]
        activation = getattr(first, "activation", None)
        clamped = None
        if activation == "clamped_swiglu":
            clamped = (float(first.alpha), float(first.limit))
        elif activation != "silu":
            return False
        gate_up, down = pairs[0]
        biases = None
        if gate_up.bias is not None and down.bias is not None:

            def stacked(layers: list[QuantLinear]) -> list[float]:
                return torch.cat(
                    [cast(torch.Tensor, m.bias).detach().float() for m in layers]
                ).tolist()

            biases = (stacked([g for g, _ in pairs]), stacked([d for _, d in pairs]))
        bias = self.gate.bias
        router_bias = None if bias is None else bias.detach().float().tolist()
        self.native = CpuMoeExperts(
            router.contiguous().numpy(),
            self.top_k,
            self.renormalize,
            [g.weight.detach().numpy() for g, _ in pairs],
            [d.weight.detach().numpy() for _, d in pairs],
            gate_up.fmt,
            down.fmt,
            gate_up.in_features,
            down.in_features,
            router_bias,
            biases,
            clamped,
            gate_up.packed,
        )
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.shape[0] <= quant_linear.DEQUANTIZE_ABOVE_ROWS:
            x = x.to(torch.float32).contiguous()
            out = torch.empty_like(x)
            self.native.forward(out.numpy(), x.numpy(), kernel_threads())
        else:
            weights, ids = route(self.gate(x), self.top_k, self.renormalize)
            out = run_experts(x, weights, ids, self.experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate.to(out.dtype) * self.shared_expert(x.to(out.dtype))
        return distributed.all_reduce(out)
