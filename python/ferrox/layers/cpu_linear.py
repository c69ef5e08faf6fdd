"""Linear layers on the CPU with weights repacked once, at load, into
oneDNN's blocked layout (torch's `mkldnn` linear ops).

On float32 CPU models the packed layout reads each weight once however many
rows multiply it: a decode (1 row) reads the LM head about twice as fast as
`F.linear`, and the few rows of a speculative verification (2-17) about
three times as fast (`benches/speculative.py` prints the effect on decoding).
Results equal `F.linear`'s up to float32 summation order.

oneDNN's op costs about 14 us a call whatever the shape, where `F.linear`
costs about 2 us plus the arithmetic at half the packed layout's speed; so a
small weight (at most SMALL_WEIGHT elements) is also kept as it is, and a
product of at most SMALL_PRODUCT weight elements times rows (a tiny model's
decode step, a draft model's) runs through `F.linear`
(`python benches/cpu_linear.py --small` prints both per shape).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("ferrox")

SMALL_WEIGHT = 1 << 18
SMALL_PRODUCT = 1 << 20


def packed_linear_supported() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight repacked for oneDNN (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # Rows up to which F.linear on the plain weight is the faster (0: never).
        self.plain_rows = SMALL_PRODUCT // weight.numel() if weight.numel() <= SMALL_WEIGHT else 0
        self.plain: torch.Tensor | None = weight.clone() if self.plain_rows else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.plain is not None and x2.shape[0] <= self.plain_rows:
            out = F.linear(x2, self.plain, self.bias)
            return out.view(*shape[:-1], self.out_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every plain `nn.Linear` in `model`."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]


def pack_linear_layers(model: nn.Module) -> int:
    """Replaces every `nn.Linear` of a float32 CPU model with a PackedLinear;
    returns how many (0 where torch lacks the ops)."""
    if not packed_linear_supported():
        return 0
    targets = [
        (parent, name, child)
        for parent, name, child in linear_layers(model)
        if child.weight.device.type == "cpu" and child.weight.dtype == torch.float32
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
