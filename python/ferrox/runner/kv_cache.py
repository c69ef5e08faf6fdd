"""The paged KV pool: per layer, K and V of `[num_blocks, block_size,
num_kv_heads, head_dim]`, carved out of one allocation."""

from __future__ import annotations

import torch

from ferrox.common.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.base import CausalLM, FullAttention


def kv_layout(model: CausalLM) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the paged KV pool a model's layers
    need: every layer full attention, all of one shape (other kinds of
    per-layer state are refused here until the pool manages them)."""
    states = model.layer_states()
    kinds = sorted({type(s).__name__ for s in states if not isinstance(s, FullAttention)})
    if kinds:
        raise UnsupportedModelError(f"layers with {kinds} state are not supported yet")
    shapes = {(s.num_kv_heads, s.head_dim) for s in states}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"layers of different KV shapes {sorted(shapes)} are not supported yet"
        )
    ((num_kv_heads, head_dim),) = shapes
    return len(states), num_kv_heads, head_dim


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
