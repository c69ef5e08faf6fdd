"""x @ W^T over block-quantized weights on the GPU: the weight is read in its
4- or 8-bit form and dequantized tile by tile in registers, in front of the
tensor-core dot (a quarter or half of bfloat16's bytes read per step).

The llama.cpp blocks (`q8_0`: a float16 scale and 32 int8 per 34 bytes;
`q4_1`: a float16 scale and offset and 32 4-bit values per 20 bytes) are
split once at load (`split_blocks`) into plain arrays the kernel loads in
whole tiles: the quantized values [N, K] (int8) or [N, K / 2] (uint8, the
bytes as stored: byte i of a block holds value i in its low nibble and value
i + 16 in its high one), and the scales (and offsets) [N, K / 32] in float16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.triton_kernels.paged_attention import _mma

GROUP = 32  # values per block, one scale (and offset) each


@dataclass(frozen=True)
class SplitBlocks:
    """A block-format weight split for the kernel (see the module doc)."""

    fmt: str
    values: torch.Tensor  # q8_0: int8 [N, K]; q4_1: uint8 [N, K / 2]
    scales: torch.Tensor  # float16 [N, K / 32]
    offsets: torch.Tensor | None  # q4_1: float16 [N, K / 32]

    @property
    def out_features(self) -> int:
        return int(self.values.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.scales.shape[1]) * GROUP


def split_blocks(blocks: torch.Tensor, fmt: str, in_features: int) -> SplitBlocks:
    """Splits uint8 blocks [N, K / 32 * block bytes] (on any device)."""
    n = blocks.shape[0]
    groups = in_features // GROUP
    b = blocks.reshape(n, groups, -1)
    scales = b[..., 0:2].contiguous().view(torch.float16).reshape(n, groups)
    if fmt == "q8_0":
        values = b[..., 2:].contiguous().view(torch.int8).reshape(n, in_features)
        return SplitBlocks(fmt, values, scales, None)
    if fmt == "q4_1":
        offsets = b[..., 2:4].contiguous().view(torch.float16).reshape(n, groups)
        values = b[..., 4:].contiguous().reshape(n, in_features // 2)
        return SplitBlocks(fmt, values, scales, offsets)
    raise ValueError(f"unknown block format {fmt!r}")


def dequantize_split(w: SplitBlocks, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight (or its `rows`) in float32 [rows, K], with torch ops (an
    embedding lookup, and the kernel's reference)."""
    values, scales = w.values, w.scales
    offsets = w.offsets
    if rows is not None:
        values, scales = values[rows], scales[rows]
        offsets = None if offsets is None else offsets[rows]
    n = values.shape[0]
    groups = scales.shape[1]
    if w.fmt == "q8_0":
        q = values.reshape(n, groups, GROUP).to(torch.float32)
        out = q * scales.to(torch.float32)[..., None]
    else:
        packed = values.reshape(n, groups, GROUP // 2)
        q = torch.cat([packed & 0xF, packed >> 4], dim=-1).to(torch.float32)
        assert offsets is not None
        out = q * scales.to(torch.float32)[..., None] + offsets.to(torch.float32)[..., None]
    return out.reshape(n, groups * GROUP)


@triton.jit
def _dequant_matmul_kernel(
    x_ptr,  # [M, K]
    v_ptr,  # values: int8 [N, K] or uint8 [N, K / 2]
    s_ptr,  # float16 [N, K / 32]
    o_ptr,  # float16 [N, K / 32] (q4_1)
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_vn,
    stride_sn,
    stride_om,
    IS_Q4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
    DOT_FP32: tl.constexpr,  # float32 operands at full precision (see _mma)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        group = ks // 32
        scale = tl.load(
            s_ptr + cols64[None, :] * stride_sn + group[:, None], mask=w_mask, other=0.0
        ).to(tl.float32)
        if IS_Q4:
            within = ks % 32
            byte = group * 16 + within % 16
            packed = tl.load(
                v_ptr + cols64[None, :] * stride_vn + byte[:, None], mask=w_mask, other=0
            )
            shift = (within // 16 * 4).to(tl.uint8)
            q = ((packed >> shift[:, None]) & 0xF).to(tl.float32)
            offset = tl.load(
                o_ptr + cols64[None, :] * stride_sn + group[:, None], mask=w_mask, other=0.0
            ).to(tl.float32)
            w = q * scale + offset
        else:
            q = tl.load(v_ptr + cols64[None, :] * stride_vn + ks[:, None], mask=w_mask, other=0)
            w = q.to(tl.float32) * scale
        acc += _mma(x, w.to(x_ptr.dtype.element_ty), DOT_FP32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def dequant_matmul(
    x: torch.Tensor, w: SplitBlocks, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, accumulated in
    float32. No host sync: capturable in a CUDA graph."""
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    block_k = 64 if k % 64 == 0 else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _dequant_matmul_kernel[grid](
        x2,
        w.values,
        w.scales,
        w.scales if w.offsets is None else w.offsets,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        x2.stride(0),
        w.values.stride(0),
        w.scales.stride(0),
        out.stride(0),
        IS_Q4=w.fmt == "q4_1",
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_FP32=x.dtype == torch.float32
        or (x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"),
    )
    return out.view(*x.shape[:-1], n)
