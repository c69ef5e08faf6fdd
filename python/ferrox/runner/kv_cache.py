"""The paged KV pools: per layer, K and V of `[num_blocks, block_size,
num_kv_heads, head_dim]`, carved out of one allocation per pool. A model
with sliding-window layers has two pools, the full-attention layers' and the
window layers' (`ModelKV`), each indexed by its own block tables (the Rust
scheduler's two allocators)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox.common.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.base import CausalLM, FullAttention, SlidingWindowAttention


@dataclass(frozen=True)
class KVGroups:
    """Which of a model's layers keep full-attention KV and which keep a
    sliding window's, all of one KV shape."""

    num_kv_heads: int
    head_dim: int
    full_layers: list[int]
    window_layers: list[int]
    sliding_window: int | None


def kv_groups(model: CausalLM) -> KVGroups:
    """The layer groups of a model's paged KV (other kinds of per-layer
    state, and sliding windows of different lengths, are refused)."""
    states = model.layer_states()
    known = (FullAttention, SlidingWindowAttention)
    kinds = sorted({type(s).__name__ for s in states if not isinstance(s, known)})
    if kinds:
        raise UnsupportedModelError(f"layers with {kinds} state are not supported yet")
    shapes = {(s.num_kv_heads, s.head_dim) for s in states}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"layers of different KV shapes {sorted(shapes)} are not supported yet"
        )
    windows = {s.window for s in states if isinstance(s, SlidingWindowAttention)}
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
    )


def kv_layout(model: CausalLM) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a model whose every layer keeps
    full-attention KV of one shape (a draft model's); other kinds of
    per-layer state are refused."""
    groups = kv_groups(model)
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


class ModelKV:
    """A model's paged KV: the full-attention pool, the window pool (a
    model with sliding-window layers), and each layer's (K, V) in model
    order. A model whose every layer has a window keeps no full pool
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
    def num_bytes(self) -> int:
        return self.full.num_bytes + (0 if self.window is None else self.window.num_bytes)
