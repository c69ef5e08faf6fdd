"""Attention over the paged KV cache for one mixed step (see
`ferrox.layers.attention.base`): rows [0, num_decodes) are decodes, the rest
are prefill chunks whose own K/V are already in the cache.

Each program serves one KV head and all G = H / Hkv query heads that share
it, so every key and value is loaded once per group.

```text
 decode:  grid (B_dec, Hkv, S)   split s of a row: keys [s * L, (s + 1) * L),
          L = ceil(seq_len / S) rounded up to BLOCK_N
          S > 1 -> partial (max, sum, acc) per split, merged by the reduce kernel
 prefill: grid (ceil(max_q / BLOCK_Q), B_pre, Hkv)
          tile rows = BLOCK_Q tokens x G heads, keys [0, ctx + last token of the tile]
```
"""

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256  # fewest context tokens worth a decode split of their own
_MAX_SPLITS = 64


@triton.jit
def _mma(a, b, DOT_FP32: tl.constexpr):
    # DOT_FP32: fp32 operands at full precision (fp32 caches, and bf16 under
    # the Triton interpreter, whose dot does not handle bf16).
    if DOT_FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a.to(b.dtype), b)
    return c


@triton.jit
def _tile_mask(rows, d, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr):
    # [R, 1] when head_dim is a power of two: a mask that varies along the
    # head dim would keep the loads from being vectorized.
    return rows[:, None] if HEAD_DIM == DIM_P2 else rows[:, None] & (d < HEAD_DIM)[None, :]


@triton.jit
def _attend_keys(
    q,  # [R, D] query rows of one KV head
    m_i,  # [R] running max
    l_i,  # [R] running sum
    acc,  # [R, D] running weighted values
    k_cache_ptr,
    v_cache_ptr,
    table,  # this row's block table
    table_width,
    pos,  # [N] key positions of the tile
    valid,  # [N] positions that exist
    key_ok,  # [R, N] or [1, N]: the keys each query row may see
    kv_head,
    d,
    scale,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One tile of keys folded into the online softmax: (m_i, l_i, acc)."""
    idx = pos // BLOCK_SIZE
    page = tl.load(table + idx, mask=valid & (idx < table_width), other=0).to(tl.int64)
    off = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = _tile_mask(valid, d, HEAD_DIM, DIM_P2)
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = _mma(q, tl.trans(k.to(q.dtype)), DOT_FP32) * scale  # [R, N]
    s = tl.where(key_ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _mma(p, v.to(q.dtype), DOT_FP32)  # [R, D]
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["table_width"])
def _decode_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [N, BS, Hkv, D]
    v_cache_ptr,  # [N, BS, Hkv, D]
    block_table_ptr,  # [B, W] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, H, D], written when NUM_SPLITS == 1
    part_acc_ptr,  # [B_dec, H, S, DIM_P2] fp32, written when NUM_SPLITS > 1
    part_max_ptr,  # [B_dec, H, S] fp32
    part_sum_ptr,  # [B_dec, H, S] fp32
    scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    table_width,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, DIM_P2)
    heads = kv_head * GROUP + g  # [G]
    g_mask = g < GROUP
    io_mask = _tile_mask(g_mask, d, HEAD_DIM, DIM_P2)
    q_off = row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # [G, D]

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    table = block_table_ptr + row.to(tl.int64) * stride_bt
    n = tl.arange(0, BLOCK_N)
    for pos0 in range(start, end, BLOCK_N):
        pos = pos0 + n  # [BLOCK_N]
        valid = pos < end
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, table_width, pos, valid,
            valid[None, :], kv_head, d, scale, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, DIM_P2, BLOCK_SIZE, DOT_FP32,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        # An empty row (seq_len 0, a padded slot of a captured batch) gives zeros.
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (row * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # [G]
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * DIM_P2 + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,  # [B_dec, H, S, DIM_P2] fp32
    part_max_ptr,  # [B_dec, H, S] fp32
    part_sum_ptr,  # [B_dec, H, S] fp32
    out_ptr,  # [T, H, D]
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = (row * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)  # [S]
    d = tl.arange(0, DIM_P2)
    m = tl.load(part_max_ptr + s)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [S], 0 for empty splits
    total = tl.sum(tl.load(part_sum_ptr + s) * w, 0)
    acc = tl.sum(tl.load(part_acc_ptr + s[:, None] * DIM_P2 + d[None, :]) * w[:, None], 0)
    o = acc / tl.where(total == 0.0, 1.0, total)  # [D]
    o_off = row.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["first_row", "table_width"])
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [N, BS, Hkv, D]
    v_cache_ptr,  # [N, BS, Hkv, D]
    block_table_ptr,  # [B, W] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    out_ptr,  # [T, H, D]
    scale,  # softmax scale * log2(e)
    first_row,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    table_width,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    q_block = tl.program_id(0)
    row = first_row + tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    num_cached = seq_len - q_len

    # Tile row r holds token r // GROUP_P2 of the block and query head r % GROUP_P2.
    r = tl.arange(0, BLOCK_Q * GROUP_P2)
    tok = q_block * BLOCK_Q + r // GROUP_P2  # [M] token index inside the chunk
    g = r % GROUP_P2
    heads = kv_head * GROUP + g  # [M]
    d = tl.arange(0, DIM_P2)
    io_mask = _tile_mask((tok < q_len) & (g < GROUP), d, HEAD_DIM, DIM_P2)
    tokens = (q_start + tok).to(tl.int64)
    q_off = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # [M, D]
    q_pos = num_cached + tok  # [M]; padded rows sit past seq_len and still see key 0

    m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, DIM_P2], tl.float32)
    table = block_table_ptr + row.to(tl.int64) * stride_bt
    n = tl.arange(0, BLOCK_N)
    kv_end = tl.minimum(seq_len, num_cached + (q_block + 1) * BLOCK_Q)
    for pos0 in range(0, kv_end, BLOCK_N):
        pos = pos0 + n  # [N]
        valid = pos < kv_end
        causal = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, table_width, pos, valid,
            causal, kv_head, d, scale, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, DIM_P2, BLOCK_SIZE, DOT_FP32,
        )  # fmt: skip

    o = acc / l_i[:, None]
    o_off = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)


# Launchers. Every size below comes from tensor shapes and the host ints
# num_decodes / max_query_len / max_seq_len; none reads device memory, so the
# decode launch can be captured in a CUDA graph. Static across replays of a
# capture: the tensors' shapes, dtypes and addresses, num_decodes, scale and
# the split count (pass num_kv_splits, or the same max_seq_len, e.g. the
# model's length limit, at capture and replay). seq_lens and block_table
# contents may change freely; a padded row with seq_len 0 yields zeros.


def _dims(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int, int, bool]:
    """(group size, its power of two, padded head_dim, whether dots run in fp32)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"q has {num_heads} heads of {head_dim}, the cache {num_kv_heads} of "
            f"{k_cache.shape[3]}: heads must be a multiple of kv heads, dims equal"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches need a contiguous last dim, the caches one layout")
    group = num_heads // num_kv_heads
    interpreted = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    dot_fp32 = q.dtype == torch.float32 or interpreted
    dim_p2 = max(triton.next_power_of_2(head_dim), 16)  # tl.dot needs K >= 16
    return group, triton.next_power_of_2(group), dim_p2, dot_fp32


def _prefill_tiles(itemsize: int, dim_p2: int) -> tuple[int, int, int, int]:
    """(tile rows, keys per step, warps, stages) that fit an H100/H200's
    registers without spilling; fp32 dots run on FMA units, so smaller."""
    if itemsize == 4:
        return (64 if dim_p2 <= 128 else 32), 16, 8, 2
    if dim_p2 > 128:
        return 64, 32, 8, 2
    return 128, 64, (8 if dim_p2 >= 64 else 4), 3


def num_kv_splits_for(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Decode splits: more than one only when the batch leaves SMs idle
    (num_decodes * Hkv < 2 * SMs) and contexts are long; a power of two."""
    if device.type != "cuda" or num_decodes == 0:
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_decodes * num_kv_heads
    if programs >= 2 * num_sms or max_seq_len < 2 * _MIN_SPLIT_TOKENS:
        return 1
    splits = min(triton.cdiv(2 * num_sms, programs), max_seq_len // _MIN_SPLIT_TOKENS, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def paged_decode(
    q: torch.Tensor,  # [T, H, D]; rows [0, num_decodes) are read
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [T, H, D]; rows [0, num_decodes) are written
    *,
    num_decodes: int,
    max_seq_len: int,
    scale: float,
    num_kv_splits: int | None = None,
) -> None:
    """One query per row over its whole cached context (seq_lens[row] tokens)."""
    if num_decodes == 0:
        return
    group, group_p2, dim_p2, dot_fp32 = _dims(q, k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    splits = num_kv_splits or num_kv_splits_for(num_decodes, num_kv_heads, max_seq_len, q.device)
    if splits & (splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two, got {splits}")
    num_heads = q.shape[1]
    part_acc = part_max = part_sum = out  # unused placeholders when not splitting
    if splits > 1:
        shape = (num_decodes, num_heads, splits)
        part_acc = q.new_empty((*shape, dim_p2), dtype=torch.float32)  # [B, H, S, D]
        part_max = q.new_empty(shape, dtype=torch.float32)  # [B, H, S]
        part_sum = q.new_empty(shape, dtype=torch.float32)  # [B, H, S]
    block_n = 64 if dim_p2 <= 128 and q.element_size() == 2 else 32
    _decode_kernel[(num_decodes, num_kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_acc, part_max, part_sum,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), block_table.shape[1],
        GROUP=group, GROUP_P2=max(group_p2, 16), HEAD_DIM=head_dim, DIM_P2=dim_p2,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        NUM_SPLITS=splits, DOT_FP32=dot_fp32, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_P2=dim_p2, NUM_SPLITS=splits, num_warps=4,
        )  # fmt: skip


def paged_prefill(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D], already holding the chunks' own K/V
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    out: torch.Tensor,  # [T, H, D]; the rows of chunks are written
    *,
    num_decodes: int,
    max_query_len: int,
    scale: float,
) -> None:
    """Rows [num_decodes, B): chunk queries attend to the row's first
    seq_len - query_len cached tokens and causally inside the chunk."""
    num_prefills = seq_lens.shape[0] - num_decodes
    if num_prefills <= 0 or max_query_len == 0:
        return
    group, group_p2, dim_p2, dot_fp32 = _dims(q, k_cache, v_cache)
    block_m, block_n, num_warps, num_stages = _prefill_tiles(q.element_size(), dim_p2)
    block_q = max(block_m // group_p2, 1)
    grid = (triton.cdiv(max_query_len, block_q), num_prefills, k_cache.shape[2])
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out,
        scale * LOG2E, num_decodes,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), block_table.shape[1],
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=q.shape[2], DIM_P2=dim_p2,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_FP32=dot_fp32, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    *,
    num_decodes: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, D]
    """A mixed step: decode rows first, then prefill chunks (two launches)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, out,
        num_decodes=num_decodes, max_seq_len=max_seq_len, scale=scale,
        num_kv_splits=num_kv_splits,
    )  # fmt: skip
    paged_prefill(
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out,
        num_decodes=num_decodes, max_query_len=max_query_len, scale=scale,
    )  # fmt: skip
    return out
