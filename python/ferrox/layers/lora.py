"""LoRA adapters on a loaded model: several adapters and the base model in
one step.

Each adapted linear layer (whatever holds its base weight: float, oneDNN
packed or block format) is wrapped in a `LoraLinear`. Its output is the base
layer's, plus, for the tokens of each adapter in the step, `x @ A^T @ B^T`
(the adapter's scale folded into B). A merged layer (q/k/v, gate/up) holds
one slice of output columns per checkpoint module, and an adapter may adapt
any of them: one A for its slices together (a single [n, sum of ranks]
product), then one B product per slice, added into that slice's columns.

On the CPU in float32 the adapters' weights live in a native layer
(`CpuLoraLayer`, `ferrox_cpu::lora`): one call per layer and step adds every
adapter's delta, whatever the number of adapters (`benches/lora_streams.py`:
a torch op costs several microseconds, and a layer's delta is about twenty
of them per adapter). On a GPU every layer holds the adapters stacked by
slot, each merged slice at `max_rank` columns (block-diagonal B), and two
Triton kernels add every token's delta (`triton_kernels/lora.py`; not yet
run on a GPU). Otherwise (a CPU model in another dtype) the step's tokens
are grouped by adapter (`LoraStep.groups`: a group is the token indices of
the rows that run under one adapter, None when every token does), gathered
once per layer call and scattered back with `index_add_`. Base-model tokens
cost nothing. `LoraModel` owns the wrappers, the loaded adapters' weights,
and the step in flight (`LoraModel.step`). Under tensor parallelism each
rank holds its slice of every adapter, cut as the base weights are
(`LoraModel._shards`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ferrox._native import CpuLoraLayer
from ferrox.common.errors import InvalidArgumentError
from ferrox.common.lora import AdapterSpec, LoraTargets
from ferrox.layers.native import kernel_threads

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LoraSlice:
    """One checkpoint module's output columns in a (possibly merged) layer."""

    module: str  # the checkpoint name: q_proj, k_proj, ..., down_proj
    start: int
    size: int


@dataclass(frozen=True)
class LoraSite:
    """A linear layer an adapter may adapt: decoder layer `layer`'s
    `getattr(parent, attr)`, whose output holds `slices`."""

    layer: int
    parent: nn.Module
    attr: str
    slices: tuple[LoraSlice, ...]


@dataclass
class LoraStep:
    """The step's adapters: each token's (0: none) and the distinct ones;
    `LoraModel.step` adds what its mode reads."""

    token_adapters: np.ndarray  # [T] uint32
    adapters: list[int]  # the distinct adapters (not 0)
    # (torch mode) per adapter, its token indices (None: every token)
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    # (stacked mode) each token's slot on the device, -1 for none
    token_slots: torch.Tensor | None = None

    @classmethod
    def of(cls, adapters: np.ndarray, query_start_loc: np.ndarray) -> LoraStep | None:
        """From the plan's per-row adapters and query starts; None when no
        row has an adapter."""
        if not adapters.any():
            return None
        per_token = np.repeat(adapters, np.diff(query_start_loc)).astype(np.uint32)
        return cls(per_token, np.unique(adapters[adapters != 0]).tolist())


@dataclass
class _Weights:
    """One adapter's weights in one LoraLinear: A of its slices stacked
    [sum r, in], and per slice (its columns, A's rows, B [size, r] * scale)."""

    a: torch.Tensor
    b: list[tuple[LoraSlice, int, int, torch.Tensor]]


# Where a LoraLinear's adapters live and run (LoraModel picks one per model).
MODES = ("native", "stacked", "torch")


class LoraLinear(nn.Module):
    def __init__(
        self, base: nn.Module, slices: tuple[LoraSlice, ...], mode: str, max_rank: int
    ) -> None:
        """`mode`: "native", the adapters in a `CpuLoraLayer` (CPU, float32);
        "stacked", stacked by slot for the Triton kernels (a GPU); "torch",
        torch ops per adapter."""
        super().__init__()
        self.base = base
        self.slices = slices
        self.mode = mode
        self.max_rank = max_rank
        self.fan_in, self.fan_out = int(base.in_features), int(base.out_features)  # type: ignore[arg-type]
        self.adapters: dict[int, _Weights] = {}  # (torch)
        self.native = None
        if mode == "native":
            spans = [(s.start, s.size) for s in slices]
            self.native = CpuLoraLayer(self.fan_in, self.fan_out, spans)
        # (stacked) [slots, slices * max_rank, in] and [slots, out, slices * max_rank]
        self.a_stack: torch.Tensor | None = None
        self.b_stack: torch.Tensor | None = None
        self.step: LoraStep | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step
        if step is None:
            return out
        if self.native is not None:
            x = x.contiguous()
            self.native.apply(x.numpy(), out.numpy(), step.token_adapters, kernel_threads())
            return out
        if self.mode == "stacked":
            if self.a_stack is not None and self.b_stack is not None:
                from ferrox.triton_kernels.lora import lora_expand, lora_shrink

                assert step.token_slots is not None
                h = lora_shrink(x, self.a_stack, step.token_slots)
                lora_expand(h, self.b_stack, step.token_slots, out)
            return out
        for adapter, rows in step.groups:
            w = self.adapters.get(adapter)
            if w is None:
                continue  # (the adapter leaves this layer as it is)
            xa = x if rows is None else x.index_select(0, rows)
            h = xa @ w.a.T  # [n, sum r]
            for sl, r0, r1, b in w.b:
                delta = h[:, r0:r1] @ b.T  # [n, size]
                cols = out[:, sl.start : sl.start + sl.size]
                if rows is None:
                    cols += delta
                else:
                    cols.index_add_(0, rows, delta)
        return out


class LoraModel:
    """The adapters a model serves: wraps every site the model declares
    (`lora_sites`) and holds each loaded adapter's weights in them."""

    def __init__(
        self,
        model: nn.Module,
        targets: LoraTargets,
        sites: list[LoraSite],
        mode: str,
        shard_of: Callable[[str, tuple[int, ...]], tuple[int, int, int] | None],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`mode`: one of MODES (see LoraLinear). `shard_of`: the model's
        (dim, start, length) of each checkpoint weight this tensor-parallel
        rank holds (None: whole). `max_rank`: the largest rank (the stacked
        mode's width per slice). `dtype`, `device`: the adapters' (the
        model's; the native mode holds float16)."""
        if mode not in MODES:
            raise InvalidArgumentError(f"LoRA mode must be one of {MODES}, got {mode!r}")
        self.dtype, self.device = dtype, device
        self.model = model
        self.targets = targets
        self.shard_of = shard_of
        self.mode = mode
        self.layers: list[list[LoraLinear]] = [[] for _ in range(targets.num_layers)]
        for site in sites:
            base = getattr(site.parent, site.attr)
            wrapped = LoraLinear(base, site.slices, mode, max_rank)
            setattr(site.parent, site.attr, wrapped)
            self.layers[site.layer].append(wrapped)
        self.loaded: set[int] = set()
        self.slots: dict[int, int] = {}  # (stacked) adapter -> its slot in the stacks

    def add(
        self,
        adapter: int,
        spec: AdapterSpec,
        tensors: dict[tuple[int, str, str], torch.Tensor],
    ) -> None:
        """Installs an adapter's tensors ((layer, module, "A"/"B") -> tensor,
        as `read_adapter` checked them) under id `adapter`."""
        if adapter in self.loaded:
            raise InvalidArgumentError(f"adapter {adapter} is already loaded")
        tensors = self._shards(tensors)
        if self.mode == "stacked":
            self._add_stacked(adapter, spec, tensors)
            return
        dtype, device = self.dtype, self.device
        for layer, wrappers in enumerate(self.layers):
            for wrapped in wrappers:
                mine = [s for s in wrapped.slices if (layer, s.module, "A") in tensors]
                if not mine:
                    continue
                a = torch.cat([tensors[(layer, s.module, "A")] for s in mine])
                parts = []
                for i, s in enumerate(mine):
                    b = tensors[(layer, s.module, "B")].to(torch.float32) * spec.scale
                    r0 = i * spec.rank
                    parts.append((s, r0, r0 + spec.rank, b.to(device, dtype).contiguous()))
                if wrapped.native is not None:
                    index = {s: j for j, s in enumerate(wrapped.slices)}
                    bs = [(index[s], b.numpy()) for s, _, _, b in parts]
                    wrapped.native.add(adapter, spec.rank, a.contiguous().numpy(), bs)
                    continue
                wrapped.adapters[adapter] = _Weights(a.to(device, dtype).contiguous(), parts)
        self.loaded.add(adapter)

    def _add_stacked(
        self,
        adapter: int,
        spec: AdapterSpec,
        tensors: dict[tuple[int, str, str], torch.Tensor],
    ) -> None:
        """The adapter in a free slot of every layer's stacks (grown as
        needed): slice j's A in rows j * max_rank ..., its B in the slice's
        output rows and the same columns; zeros where it adapts nothing."""
        dtype, device = self.dtype, self.device
        slot = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
        for layer, wrappers in enumerate(self.layers):
            for w in wrappers:
                width = len(w.slices) * w.max_rank
                if w.a_stack is None or w.b_stack is None or w.a_stack.shape[0] <= slot:
                    grown = max(2 * slot, 1)
                    a_new = torch.zeros(grown, width, w.fan_in, dtype=dtype, device=device)
                    b_new = torch.zeros(grown, w.fan_out, width, dtype=dtype, device=device)
                    if w.a_stack is not None and w.b_stack is not None:
                        a_new[: w.a_stack.shape[0]] = w.a_stack
                        b_new[: w.b_stack.shape[0]] = w.b_stack
                    w.a_stack, w.b_stack = a_new, b_new
                w.a_stack[slot].zero_()
                w.b_stack[slot].zero_()
                for j, s in enumerate(w.slices):
                    if (layer, s.module, "A") not in tensors:
                        continue
                    r0, r1 = j * w.max_rank, j * w.max_rank + spec.rank
                    a = tensors[(layer, s.module, "A")]
                    b = tensors[(layer, s.module, "B")].to(torch.float32) * spec.scale
                    w.a_stack[slot, r0:r1] = a.to(device, dtype)
                    w.b_stack[slot, s.start : s.start + s.size, r0:r1] = b.to(device, dtype)
        self.slots[adapter] = slot
        self.loaded.add(adapter)

    def _shards(
        self, tensors: dict[tuple[int, str, str], torch.Tensor]
    ) -> dict[tuple[int, str, str], torch.Tensor]:
        """This rank's slice of each tensor, as the base weight is split: a
        column-parallel module's B by rows (its output columns), a
        row-parallel module's A by columns (its input rows); the deltas of
        row-parallel layers are partial sums the layer's all-reduce adds."""
        out = {}
        for (layer, module, part), t in tensors.items():
            group = "self_attn" if module in _ATTENTION else "mlp"
            fan_in, fan_out = self.targets.modules[module]
            name = f"layers.{layer}.{group}.{module}.weight"
            shard = self.shard_of(name, (fan_out, fan_in))
            if shard is not None:
                dim, start, length = shard
                if dim == 0 and part == "B":
                    t = t[start : start + length]
                elif dim == 1 and part == "A":
                    t = t[:, start : start + length]
            out[(layer, module, part)] = t.contiguous()
        return out

    def remove(self, adapter: int) -> None:
        for wrappers in self.layers:
            for wrapped in wrappers:
                wrapped.adapters.pop(adapter, None)
                if wrapped.native is not None:
                    wrapped.native.remove(adapter)
        self.slots.pop(adapter, None)
        self.loaded.discard(adapter)

    @contextmanager
    def step(self, step: LoraStep | None) -> Iterator[None]:
        """Runs the step's adapters in every wrapper. A step with adapters
        runs the model module by module (the CPU's fused decode layers know
        no adapters)."""
        if step is None:
            yield
            return
        missing = set(step.adapters) - self.loaded
        if missing:
            raise InvalidArgumentError(f"adapters {sorted(missing)} are not loaded")
        if self.mode == "stacked":
            lookup = np.full(max(step.adapters) + 1, -1, dtype=np.int32)
            for adapter in step.adapters:
                lookup[adapter] = self.slots[adapter]
            step.token_slots = torch.from_numpy(lookup[step.token_adapters]).to(self.device)
        elif self.mode == "torch":
            num_tokens = len(step.token_adapters)
            for adapter in step.adapters:
                mine = np.flatnonzero(step.token_adapters == adapter)
                rows = None if len(mine) == num_tokens else torch.from_numpy(mine).to(self.device)
                step.groups.append((adapter, rows))
        model: Any = self.model
        fused = model.fused_decode
        model.fused_decode = None
        self._set(step)
        try:
            yield
        finally:
            self._set(None)
            model.fused_decode = fused

    def _set(self, step: LoraStep | None) -> None:
        for wrappers in self.layers:
            for wrapped in wrappers:
                wrapped.step = step
