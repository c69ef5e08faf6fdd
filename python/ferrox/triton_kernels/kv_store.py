"""Scatters a step's new keys and values into the paged KV cache."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [N, BS, Hkv, D]
    v_cache_ptr,  # [N, BS, Hkv, D]
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padded row of a captured batch writes nothing
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, DIM_P2)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    page = slot // BLOCK_SIZE
    dst = page * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = dst + heads[:, None] * stride_ch + dims[None, :]  # [HEADS_P2, DIM_P2]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Writes token t's K/V at slot `slot_mapping[t]` (block slot // BS,
    offset slot % BS); slots of -1 are skipped. No host sync: capturable."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous last dim")
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        DIM_P2=triton.next_power_of_2(head_dim),
    )
