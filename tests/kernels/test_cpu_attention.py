"""The CPU attention backend's row routing: rows behind a computed context
(a prefix-cache hit's tail, a later chunk), of any length, go to the paged
kernel, as do short fresh rows, and give what the torch backend gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrox.layers.attention import cpu_backend
from ferrox.layers.attention.base import AttentionMetadata
from ferrox.layers.attention.cpu_backend import CpuAttentionBackend
from ferrox.layers.attention.torch_backend import TorchAttentionBackend

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 16


def metadata(rows: list[tuple[int, int]], shared: int) -> AttentionMetadata:
    """Rows of (new query tokens, tokens computed before); the first
    `shared` blocks of every context that holds them whole are the same
    blocks (a cached prefix)."""
    width = max(-(-(q + c) // BLOCK) for q, c in rows)
    table = np.arange(len(rows) * width, dtype=np.int32).reshape(len(rows), width)
    for r, (_, c) in enumerate(rows):
        if c >= shared * BLOCK:
            table[r, :shared] = table[0, :shared]
    slots = [
        table[r, p // BLOCK] * BLOCK + p % BLOCK
        for r, (q, c) in enumerate(rows)
        for p in range(c, c + q)
    ]
    starts = np.concatenate([[0], np.cumsum([q for q, _ in rows])]).astype(np.int32)
    seq_lens = np.array([q + c for q, c in rows], dtype=np.int32)
    return AttentionMetadata(
        num_reqs=len(rows),
        num_decodes=sum(q == 1 for q, _ in rows),
        num_tokens=int(starts[-1]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=torch.from_numpy(table),
        query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        num_computed_cpu=np.array([c for _, c in rows], dtype=np.int32),
        max_query_len=max(q for q, _ in rows),
        max_seq_len=int(seq_lens.max()),
        block_table_cpu=table,
    )


# Decodes first, as the scheduler orders them; then rows behind a context
# from just past the short limit to long ones, and fresh prompts on either
# side of the short limit.
ROWS = [(1, 37), (1, 9), (18, 40), (64, 5), (40, 64), (65, 70), (17, 0), (40, 0), (130, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_row_takes_the_paged_kernel_and_matches_torch(dtype: torch.dtype) -> None:
    meta = metadata(ROWS, shared=2)
    # (the split itself: the fresh 40-token row is the one past 17 without a context)
    short, long = meta.row_split(cpu_backend.SHORT_QUERY_LEN, 1 << 30)
    assert short.tolist() == [0, 1, 2, 3, 4, 5, 6, 8] and long.tolist() == [7]
    meta._row_split = None
    short, long = meta.row_split(
        cpu_backend.PAGED_FRESH_QUERY_LEN, cpu_backend.SHORT_QUERY_LEN_AFTER_CONTEXT
    )
    assert short.tolist() == list(range(len(ROWS))) and not len(long)
    g = torch.Generator().manual_seed(0)
    num_blocks = int(meta.block_table_cpu.max()) + 1
    cache = (num_blocks, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(cache, generator=g).to(dtype)
    v_cache = torch.randn(cache, generator=g).to(dtype)
    q = torch.randn(meta.num_tokens, HEADS, DIM, generator=g)
    k = torch.randn(meta.num_tokens, KV_HEADS, DIM, generator=g)
    v = torch.randn(meta.num_tokens, KV_HEADS, DIM, generator=g)
    scale = DIM**-0.5
    want = TorchAttentionBackend(HEADS, KV_HEADS, DIM, scale).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), meta
    )
    meta._row_split = None
    got = CpuAttentionBackend(HEADS, KV_HEADS, DIM, scale).forward(q, k, v, k_cache, v_cache, meta)
    # (float16: the torch path attends a fresh prompt over its unrounded K/V,
    # the paged kernel over the cache's)
    atol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
