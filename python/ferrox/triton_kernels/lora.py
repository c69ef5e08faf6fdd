"""LoRA deltas on a GPU, each token under its own adapter (BGMV-style): the
adapters' weights stacked by slot, `shrink` h[t] = A[slot[t]] @ x[t], then
`expand` out[t] += B[slot[t]] @ h[t]. A slot of -1 (the base model) adds
nothing. A merged layer's slices share one stacked A ([S, slices * r_max,
K]) and one block-diagonal B ([S, N, slices * r_max]): slice j's rows of B
read only columns j * r_max ... of h, zeros elsewhere (layers/lora.py).
Not yet run on a GPU; tested under the Triton interpreter."""

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    slot_ptr,  # [T] int32
    h_ptr,  # [T, R] float32
    K,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + ks, mask=ks < K, other=0.0).to(tl.float32)
            a_mask = (rs[:, None] < R) & (ks[None, :] < K)
            a_offs = slot * stride_as + rs[:, None] * stride_ar + ks[None, :]
            a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_ht + rs, acc, mask=rs < R)


@triton.jit
def _expand_kernel(
    h_ptr,  # [T, R] float32
    b_ptr,  # [S, N, R]
    slot_ptr,  # [T] int32
    out_ptr,  # [T, N]
    N,
    R,
    stride_ht,
    stride_bs,
    stride_bn,
    stride_ot,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            h = tl.load(h_ptr + t * stride_ht + rs, mask=rs < R, other=0.0)
            b_mask = (ns[:, None] < N) & (rs[None, :] < R)
            b_offs = slot * stride_bs + ns[:, None] * stride_bn + rs[None, :]
            b = tl.load(b_ptr + b_offs, mask=b_mask, other=0.0).to(tl.float32)
            acc += tl.sum(b * h[None, :], axis=1)
        o_ptrs = out_ptr + t * stride_ot + ns
        o = tl.load(o_ptrs, mask=ns < N, other=0.0).to(tl.float32)
        tl.store(o_ptrs, (o + acc).to(out_ptr.dtype.element_ty), mask=ns < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h [T, R] float32: A[slots[t]] @ x[t] (zero where slots[t] < 0)."""
    num_tokens, k = x.shape
    r = a.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = a.contiguous()
    h = torch.empty(num_tokens, r, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    block_r = min(triton.next_power_of_2(r), 64)
    grid = (num_tokens, triton.cdiv(r, block_r))
    _shrink_kernel[grid](
        x, a, slots, h, k, r, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] += B[slots[t]] @ h[t] in place (nothing where slots[t] < 0)."""
    num_tokens, r = h.shape
    n = b.shape[1]
    if num_tokens == 0:
        return
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim")
    b = b.contiguous()
    block_n = 64
    grid = (num_tokens, triton.cdiv(n, block_n))
    _expand_kernel[grid](
        h, b, slots, out, n, r, h.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_R=min(triton.next_power_of_2(r), 64),
    )  # fmt: skip
