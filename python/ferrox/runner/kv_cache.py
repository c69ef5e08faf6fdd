"""The paged KV pool: per layer, K and V of `[num_blocks, block_size,
num_kv_heads, head_dim]`, carved out of one allocation."""

from __future__ import annotations

import torch

from ferrox.errors import InvalidArgumentError


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
