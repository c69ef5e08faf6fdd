"""The mixture-of-experts block (layers/moe.py) against a per-token float
reference, over odd shapes, float and block-format experts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ferrox.layers.moe import SparseMoe, route, run_experts
from ferrox.layers.quant_linear import QuantLinear


class _Expert(nn.Module):
    activation = "silu"  # (what the native block reads the gate by)

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


def _reference(
    x: torch.Tensor, logits: torch.Tensor, experts: nn.ModuleList, top_k: int, renormalize: bool
) -> torch.Tensor:
    """Token by token: softmax, the k largest, each chosen expert on the token alone."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=-1)
        chosen = sorted(range(len(experts)), key=lambda e: -float(probs[e]))[:top_k]
        total = sum(float(probs[e]) for e in chosen) if renormalize else 1.0
        for e in chosen:
            out[t] += float(probs[e]) / total * experts[e](x[t : t + 1])[0]
    return out


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "hidden", "inter"),
    [
        (1, 8, 2, 64, 32),
        (7, 5, 3, 32, 96),
        (33, 16, 4, 96, 64),
        (0, 4, 1, 32, 32),
        (5, 3, 3, 64, 32),
    ],
)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("fmt", [None, "q8_0", "q4_1"])
def test_experts_match_a_per_token_reference(
    tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool,
    fmt: str | None,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(tokens * 100 + num_experts)
    torch.manual_seed(tokens + top_k)
    experts = nn.ModuleList(_Expert(hidden, inter) for _ in range(num_experts))
    if fmt is not None:  # the same block-format weights in the block and the reference
        for expert in experts:
            expert.gate_up_proj = QuantLinear.from_linear(expert.gate_up_proj, fmt)
            expert.down_proj = QuantLinear.from_linear(expert.down_proj, fmt)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = 3 * torch.randn(tokens, num_experts, generator=gen)
    with torch.inference_mode():
        weights, ids = route(logits, top_k, renormalize)
        got = run_experts(x, weights, ids, experts)
        want = _reference(x, logits, experts, top_k, renormalize)
    assert got.shape == (tokens, hidden)
    # (a block-format expert rounds its input per call: alone or in a group alike)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_routing_weights_and_choices() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [5.0, 5.5, -3.0, 0.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [1, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_an_expert_no_token_chose_is_not_run() -> None:
    calls: list[int] = []

    class Counting(_Expert):
        def __init__(self, index: int) -> None:
            super().__init__(32, 32)
            self.index = index

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(self.index)
            return super().forward(x)

    experts = nn.ModuleList(Counting(e) for e in range(6))
    ids = torch.tensor([[4, 1], [1, 4], [4, 0]])
    weights = torch.full((3, 2), 0.5)
    run_experts(torch.randn(3, 32), weights, ids, experts)
    assert calls == [0, 1, 4]  # once each, in order


def test_a_block_refuses_more_choices_than_experts() -> None:
    from ferrox.common.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="3 experts per token out of 2"):
        SparseMoe(32, 2, 3, True, lambda: _Expert(32, 32))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_the_native_block_matches_routing_and_experts_one_at_a_time(
    fmt: str, renormalize: bool, tokens: int
) -> None:
    """Block-format experts on the CPU: the router and experts in one native
    call equal torch's routing and one QuantLinear pair per expert."""
    torch.manual_seed(tokens)
    block = SparseMoe(64, 7, 3, renormalize, lambda: _Expert(64, 96))
    for expert in block.experts:
        expert.gate_up_proj = QuantLinear.from_linear(expert.gate_up_proj, fmt)
        expert.down_proj = QuantLinear.from_linear(expert.down_proj, fmt)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.5)
    x = torch.randn(tokens, 64)
    with torch.inference_mode():
        want = block(x)
        assert block.prepare_native()
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_float_experts_do_not_run_natively() -> None:
    block = SparseMoe(32, 4, 2, True, lambda: _Expert(32, 32))
    assert not block.prepare_native() and block.native is None
