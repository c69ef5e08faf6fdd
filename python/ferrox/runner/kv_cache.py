"""The paged KV pools: per layer, K and V of `[num_blocks, block_size,
num_kv_heads, head_dim]`, carved out of one allocation per pool. A model
with sliding-window layers has two pools, the full-attention layers' and the
window layers' (`ModelKV`), each indexed by its own block tables (the Rust
scheduler's two allocators). A hybrid model's linear-attention layers keep
no KV: their fixed-size recurrent state lives in a state pool
(`StatePool`), one slot per running sequence (the Rust scheduler's state
slots)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferrox.common.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.base import (
    CausalLM,
    FullAttention,
    LinearAttentionState,
    SlidingWindowAttention,
)


@dataclass(frozen=True)
class KVGroups:
    """Which of a model's layers keep full-attention KV, which keep a
    sliding window's (all of one KV shape), and which keep a recurrent
    state (`state_layers`, each with its `LinearAttentionState`)."""

    num_kv_heads: int
    head_dim: int
    full_layers: list[int]
    window_layers: list[int]
    sliding_window: int | None
    state_layers: list[int] = field(default_factory=list)
    states: list[LinearAttentionState] = field(default_factory=list)
    # what the state pool holds the recurrent matrices in
    state_dtype: torch.dtype = torch.float32

    @property
    def state_bytes(self) -> int:
        """One sequence's recurrent state, all layers."""
        return sum(s.num_bytes(self.state_dtype.itemsize) for s in self.states)


def kv_groups(model: CausalLM, state_dtype: torch.dtype = torch.float32) -> KVGroups:
    """The layer groups of a model's per-request state (other kinds of
    per-layer state, and sliding windows of different lengths, are refused);
    `state_dtype`: what its linear-attention layers' recurrent matrices are
    held in."""
    states = model.layer_states()
    known = (FullAttention, SlidingWindowAttention, LinearAttentionState)
    kinds = sorted({type(s).__name__ for s in states if not isinstance(s, known)})
    if kinds:
        raise UnsupportedModelError(f"layers with {kinds} state are not supported yet")
    recurrent = [(i, s) for i, s in enumerate(states) if isinstance(s, LinearAttentionState)]
    paged = [s for s in states if not isinstance(s, LinearAttentionState)]
    if not paged:
        raise UnsupportedModelError("a model without attention layers is not supported yet")
    shapes = {(s.num_kv_heads, s.head_dim) for s in paged}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"layers of different KV shapes {sorted(shapes)} are not supported yet"
        )
    windows = {s.window for s in paged if isinstance(s, SlidingWindowAttention)}
    if len(windows) > 1:
        raise UnsupportedModelError(
            f"sliding windows of different lengths {sorted(windows)} are not supported yet"
        )
    ((num_kv_heads, head_dim),) = shapes
    return KVGroups(
        num_kv_heads,
        head_dim,
        [i for i, s in enumerate(states) if isinstance(s, FullAttention)],
        [i for i, s in enumerate(states) if isinstance(s, SlidingWindowAttention)],
        windows.pop() if windows else None,
        [i for i, _ in recurrent],
        [s for _, s in recurrent],
        state_dtype,
    )


def kv_layout(model: CausalLM) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a model whose every layer keeps
    full-attention KV of one shape (a draft model's); other kinds of
    per-layer state are refused."""
    groups = kv_groups(model)
    if groups.state_layers:
        raise UnsupportedModelError("a draft model with recurrent-state layers is not supported")
    if groups.window_layers:
        raise UnsupportedModelError(
            "a draft model with sliding-window layers is not supported; its KV follows the "
            "target's full-attention block tables"
        )
    return len(groups.full_layers), groups.num_kv_heads, groups.head_dim


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise InvalidArgumentError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [L, 2, N, BS, Hkv, D]. Unzeroed memory costs nothing until a block
        # is written (the OS maps pages on first touch): only for backends
        # that never read a slot before it is written.
        self.storage = (torch.zeros if zeroed else torch.empty)(
            num_layers,
            2,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """K and V of slot src[i] into slot dst[i] in every layer, every
        source read before any destination is written."""
        layers, _, blocks, block_size = self.storage.shape[:4]
        flat = self.storage.view(layers, 2, blocks * block_size, *self.storage.shape[4:])
        src_t, dst_t = (
            torch.from_numpy(np.asarray(a, dtype=np.int64)).to(self.storage.device)
            for a in (src, dst)
        )
        flat[:, :, dst_t] = flat[:, :, src_t]


class StatePool:
    """The recurrent state of a model's linear-attention layers: per layer, the
    convolution's last inputs `[num_slots, conv_dim, conv_kernel - 1]`
    (float32) and the recurrent matrices `[num_slots, heads, k_head_dim,
    v_head_dim]` (`recurrent_dtype`: float32, or bfloat16). A running
    sequence owns one slot of every layer (the Rust scheduler gives it); a
    row with no computed tokens starts its slot from zero, so a slot needs
    no clearing when it changes hands (and the pool is allocated
    uninitialised: its pages cost memory once written).

    With prefix caching, `num_snapshots` more of each: the states the
    prefix cache keeps (the state after a block boundary of a cached
    prefix). A step copies snapshots into the slots of its prefix-cache hits
    before the forward pass (`restore`) and slots into snapshots after it
    (`save`), as the plan says."""

    def __init__(
        self,
        states: list[LinearAttentionState],
        num_slots: int,
        device: torch.device,
        num_snapshots: int = 0,
        recurrent_dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_slots <= 0:
            raise InvalidArgumentError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots

        def pool(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [
                (
                    torch.empty(n, *s.conv_shape, dtype=torch.float32, device=device),
                    torch.empty(n, *s.recurrent_shape, dtype=recurrent_dtype, device=device),
                )
                for s in states
            ]

        self.layers = pool(num_slots)
        self.snapshots = pool(num_snapshots)

    def restore(self, pairs: np.ndarray) -> None:
        """[R, 2] (snapshot, slot): each slot takes its snapshot's state."""
        if len(pairs):
            src, dst = _index(pairs[:, 0]), _index(pairs[:, 1])
            for (conv, rec), (snap_conv, snap_rec) in zip(self.layers, self.snapshots, strict=True):
                conv[dst.to(conv.device)] = snap_conv[src.to(conv.device)]
                rec[dst.to(rec.device)] = snap_rec[src.to(rec.device)]

    def save(self, pairs: np.ndarray) -> None:
        """[W, 2] (slot, snapshot): each snapshot takes its slot's state."""
        if len(pairs):
            src, dst = _index(pairs[:, 0]), _index(pairs[:, 1])
            for (conv, rec), (snap_conv, snap_rec) in zip(self.layers, self.snapshots, strict=True):
                snap_conv[dst.to(conv.device)] = conv[src.to(conv.device)]
                snap_rec[dst.to(rec.device)] = rec[src.to(rec.device)]

    @property
    def num_bytes(self) -> int:
        tensors = [t for pair in self.layers + self.snapshots for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)


def _index(column: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(column.astype(np.int64))


class ModelKV:
    """A model's per-request state: the full-attention pool, the window
    pool (a model with sliding-window layers), the state pool (a model with
    linear-attention layers), and each layer's pair in model order: (K, V)
    of an attention layer, (convolution state, recurrent state) of a linear
    one. A model whose every attention layer has a window keeps no full pool
    memory: its full block tables are only the scheduler's bookkeeping."""

    def __init__(
        self,
        groups: KVGroups,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = True,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
    ) -> None:
        def pool(layers: list[int], blocks: int) -> KVCache:
            return KVCache(
                len(layers),
                blocks,
                block_size,
                groups.num_kv_heads,
                groups.head_dim,
                dtype,
                device,
                zeroed,
            )

        self.full = pool(groups.full_layers, num_blocks)
        self.window = (
            pool(groups.window_layers, num_window_blocks) if groups.window_layers else None
        )
        self.sliding_window = groups.sliding_window
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = dict(
            zip(groups.full_layers, self.full.layers, strict=True)
        )
        if self.window is not None:
            layers |= dict(zip(groups.window_layers, self.window.layers, strict=True))
        self.state = (
            StatePool(
                groups.states, num_state_slots, device, num_state_snapshots, groups.state_dtype
            )
            if groups.state_layers
            else None
        )
        if self.state is not None:
            layers |= dict(zip(groups.state_layers, self.state.layers, strict=True))
        self.layers = [layers[i] for i in range(len(layers))]

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_window_blocks(self) -> int:
        return 0 if self.window is None else self.window.num_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.full.storage.dtype

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots (0: the model has no linear-attention layers)."""
        return 0 if self.state is None else self.state.num_slots

    @property
    def num_bytes(self) -> int:
        window = 0 if self.window is None else self.window.num_bytes
        state = 0 if self.state is None else self.state.num_bytes
        return self.full.num_bytes + window + state
