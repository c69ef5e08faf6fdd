"""Linear layers and embeddings over block-quantized weights on the CPU.

Weights stay in llama.cpp's block layouts (`q4_1`: 4-bit with a float16
scale and offset per 32 weights, 0.625 bytes a weight; `q8_0`: 8-bit with a
scale, 1.06 bytes a weight; `q6_k`, as a K-quant GGUF file holds it: 6-bit
in super-blocks of 256 with a signed scale per 16, 0.82 bytes a weight;
`q4_k`, the same files' 4-bit type: a 6-bit scale and min per 32 in
super-blocks of 256, 0.56 bytes a weight),
the layout the native kernel reads
(`ferrox_cpu::quant_matmul`). A decode step multiplies a few rows by every
weight once, so reading a quarter of float32's bytes is most of the win.

Large batches (prefill) on CPUs without AVX2 dequantize the weight once per
call into a float32 scratch and use the float matmul: the portable integer
kernel is slower there (`DEQUANTIZE_ABOVE_ROWS`). With AVX2 or AVX-512
VNNI every row count runs the one integer kernel, so that a row's result
does not depend on the size of its batch.

On the CPU the blocks are rearranged once at load into the panels the
kernels read (`pack_for_cpu`: sixteen output columns interleaved four
weights at a time, `ferrox_cpu::quant_pack`), where the kernel would
otherwise rearrange them on every call; the bytes are the same, their order
is not llama.cpp's any more. On a GPU the blocks are split once at load
(`split_for_triton`) and every call runs the Triton dequantize-GEMM
(`triton_kernels/quant_matmul.py`) in the model's dtype.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ferrox._native import (
    dequantize_rows_cpu,
    pack_blocks_cpu,
    quant_gated_matmul_cpu,
    quant_layout_cpu,
    quant_matmul_cpu,
    quant_matmul_kernel_cpu,
)
from ferrox.common.errors import InvalidArgumentError
from ferrox.layers.cpu_linear import packed_linear_supported
from ferrox.layers.native import kernel_threads

if TYPE_CHECKING:
    from ferrox.triton_kernels.quant_matmul import SplitBlocks

BLOCK = 32
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q6_k": 210, "q4_k": 144}
# Weights a block holds: 32, or a K-quant's super-block.
BLOCK_VALUES = {"q4_1": BLOCK, "q8_0": BLOCK, "q6_k": 256, "q4_k": 256}
# The block formats the kernels run, the CPU's native ones and the Triton
# kernel (a GPU) alike; a file's Q6_K matrices come to Q8_0 for them
# (`loader.model_loader.block_plan`).
KERNEL_FORMATS = ("q4_1", "q8_0")
# Formats the CPU's panel kernels also run, as a GGUF file stores them, when
# asked to keep its blocks so (quantization="gguf"), in less memory and no
# faster where batches are large (benches/k_quant_blocks.py, streamed from
# memory). Q6_K reads 0.77x Q8_0's bytes but takes more instructions a
# weight to unpack: a 1024 x 49152 LM head on AVX-512 VNNI 1.27x Q8_0's
# speed at one row, 0.66-0.86x at 4 to 64; AVX2: 0.74x at one row. Q4_K
# (else given Q4_1, its scales rounded to float16) reads 0.9x Q4_1's bytes:
# on AVX-512 VNNI 1.07-1.14x Q4_1's speed at one row, 0.79-1.10x at 4 to 64;
# AVX2 0.76-0.96x at every row count. The portable loop runs them far
# slower still.
STORED_FORMATS = () if quant_matmul_kernel_cpu() == "pairs" else ("q6_k", "q4_k")

# Above this many rows a call dequantizes the weight into a reused scratch
# buffer and runs a float GEMM; weights larger than the chunk (an LM head) go
# through it a slice of rows at a time, so that the scratch stays in cache.
# Where the crossover lies depends on the integer kernel the CPU runs
# (benches/quant_linear.py): AVX-512 VNNI's and AVX2's panel kernels beat the
# float GEMM at every row count measured (1 to 2048; AVX2's by 1.6-2x from
# 256 rows up, against oneDNN's AVX2 GEMM), the pair kernel (no AVX2:
# portable code) up to about 32.
DEQUANTIZE_ABOVE_ROWS = 32 if quant_matmul_kernel_cpu() == "pairs" else sys.maxsize
DEQUANTIZE_CHUNK_ELEMENTS = 2 << 20
# Whether this CPU's kernel reads weights packed into panels (AVX2 and
# AVX-512 VNNI) rather than llama.cpp's rows (the portable kernel).
PACK_FOR_CPU = quant_layout_cpu() == "panels"

_scratch = torch.empty(0)
_ONEDNN = packed_linear_supported()


def _float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias in float32. oneDNN's linear op on the plain weight
    beats `F.linear` at prefill sizes on this path, where the weight is new
    each call and cannot be packed ahead."""
    if _ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _scratch_buffer(numel: int) -> torch.Tensor:
    """A float32 buffer of `numel` elements, reused across calls (a fresh
    allocation of megabytes costs its page faults on every call)."""
    global _scratch
    if _scratch.numel() < numel:
        _scratch = torch.empty(numel, dtype=torch.float32)
    return _scratch[:numel]


def row_bytes(fmt: str, in_features: int) -> int:
    if fmt not in BLOCK_BYTES:
        raise InvalidArgumentError(
            f"unknown block format {fmt!r}; expected one of {sorted(BLOCK_BYTES)}"
        )
    values = BLOCK_VALUES[fmt]
    if in_features % values:
        raise InvalidArgumentError(
            f"{fmt} needs input widths that are multiples of {values}, got {in_features}"
        )
    return in_features // values * BLOCK_BYTES[fmt]


def dequantize(
    weight: torch.Tensor,
    fmt: str,
    in_features: int,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    packed: bool = False,
    rows: range | None = None,
) -> torch.Tensor:
    """A block-format weight [N, row bytes] (`packed` by `pack_blocks`, or
    not) as float32 [N, in_features], or only its `rows`."""
    picked = (
        np.arange(weight.shape[0], dtype=np.int64)
        if rows is None
        else np.arange(rows.start, rows.stop, dtype=np.int64)
    )
    if out is None:
        out = torch.empty(len(picked), in_features, dtype=torch.float32)
    threads = kernel_threads() if num_threads is None else num_threads
    dequantize_rows_cpu(out.numpy(), weight.numpy(), fmt, picked, threads, packed)
    return out


def pack_blocks(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """A block-format weight [N, row bytes] in llama.cpp's rows, rearranged
    into the panels the CPU kernels read (same shape and bytes)."""
    out = torch.empty_like(weight, device="cpu")
    pack_blocks_cpu(out.numpy(), weight.detach().cpu().contiguous().numpy(), fmt)
    return out


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """A float weight [N, K] in a block format: uint8 [N, K / 32 * block bytes].

    q8_0: scale = max |w| / 127 per block, w ~ scale * round(w / scale).
    q4_1: offset = min, scale = (max - min) / 15, w ~ scale * q + offset.
    The rounding uses the float16 scale and offset as stored."""
    n, k = weight.shape
    row_bytes(fmt, k)
    if fmt not in ("q8_0", "q4_1"):
        raise InvalidArgumentError(f"float weights quantize to q8_0 or q4_1, not {fmt}")
    w = weight.detach().to(device="cpu", dtype=torch.float32).numpy().reshape(n, k // BLOCK, BLOCK)
    out = np.empty((n, k // BLOCK, BLOCK_BYTES[fmt]), dtype=np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        if fmt == "q8_0":
            d = (np.abs(w).max(-1) / 127).astype(np.float16)
            inv = np.where(d > 0, 1 / d.astype(np.float32), 0)
            q = np.clip(np.rint(w * inv[..., None]), -127, 127).astype(np.int8)
            out[..., :2] = d[..., None].view(np.uint8)
            out[..., 2:] = q.view(np.uint8)
        else:
            lo = w.min(-1).astype(np.float16)
            d = ((w.max(-1) - lo.astype(np.float32)) / 15).astype(np.float16)
            inv = np.where(d > 0, 1 / d.astype(np.float32), 0)
            q = np.rint((w - lo.astype(np.float32)[..., None]) * inv[..., None])
            q = np.clip(q, 0, 15).astype(np.uint8)
            out[..., 0:2] = d[..., None].view(np.uint8)
            out[..., 2:4] = lo[..., None].view(np.uint8)
            out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return torch.from_numpy(out.reshape(n, -1))


def scale_blocks(weight: torch.Tensor, fmt: str, factor: float) -> torch.Tensor:
    """A block-format weight [N, row bytes] times `factor`: each block's
    float16 scale (and q4_1's offset) multiplied, the codes kept; each
    scale rounds to float16 again (within 2^-11 of it, relatively)."""
    row_bytes(fmt, BLOCK_VALUES.get(fmt, BLOCK))  # (a known format)
    blocks = weight.numpy().reshape(weight.shape[0], -1, BLOCK_BYTES[fmt]).copy()
    # the float16 values that scale a block: q4_1's scale and offset and
    # q8_0's scale at its start, q6_k's d at its end, q4_k's d and dmin at
    # its start
    at = {"q4_1": slice(0, 4), "q8_0": slice(0, 2), "q6_k": slice(208, 210), "q4_k": slice(0, 4)}[
        fmt
    ]
    head = np.ascontiguousarray(blocks[..., at]).view(np.float16)
    scaled = (head.astype(np.float32) * np.float32(factor)).astype(np.float16)
    blocks[..., at] = scaled.view(np.uint8)
    return torch.from_numpy(blocks.reshape(weight.shape[0], -1))


class QuantLinear(nn.Module):
    """`nn.Linear`'s forward (float32 in and out) over a block-format weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        shape = (out_features, row_bytes(fmt, in_features))
        self.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._views: tuple[np.ndarray, np.ndarray | None] | None = None
        self._split: SplitBlocks | None = None
        # The weight is in the CPU kernels' panels (`pack_for_cpu`).
        self.packed = False
        # This layer's own DEQUANTIZE_ABOVE_ROWS (None: the module's);
        # `batch_invariant` sets no limit, one kernel for every row count.
        self.dequantize_above: int | None = None
        # the same kernel at every row count (`batch_invariant`)
        self.batch_invariant = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> QuantLinear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt)
        device = linear.weight.device
        layer.weight.data = quantize(linear.weight, fmt).to(device)
        if linear.bias is not None and layer.bias is not None:
            bias = linear.bias.detach().clone()
            layer.bias.data = bias.to(torch.float32) if device.type == "cpu" else bias
        return layer

    def split_for_triton(self, shared: dict[int, SplitBlocks]) -> None:
        """On a GPU, once loaded: splits the blocks for the Triton kernel (a
        tied LM head and its embedding share one split through `shared`) and
        drops them."""
        self._split = _split_weight(self.weight, self.fmt, self.in_features, shared)
        self.weight = _released(self.weight)

    def pack_for_cpu(self, shared: dict[int, nn.Parameter]) -> None:
        """On the CPU, once loaded: the weight in the kernels' panels (a
        tied LM head and its embedding share one packed copy through
        `shared`)."""
        self.weight = _packed(self.weight, self.fmt, shared)
        self.packed = True
        self._views = None

    def gated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """act(gate) * up of this layer's output, for a gated MLP's gate_up
        projection (the gate's columns, then up's), in one native call where
        `forward` would run the block kernels on the CPU (on AMX tiles the
        sums are activated as they leave the tiles: the [T, 2 I] output is
        never written); None elsewhere (a GPU's split blocks, rows past
        `DEQUANTIZE_ABOVE_ROWS`). `activation`: "silu" or "gelu_tanh"."""
        if not self._on_kernels(x.numel() // self.in_features):
            return None
        x2 = self._float_rows(x)
        out = torch.empty(x2.shape[0], self.out_features // 2, dtype=torch.float32)
        quant_gated_matmul_cpu(
            out.numpy(),
            x2.numpy(),
            *self._numpy_views(),
            self.fmt,
            activation,
            kernel_threads(),
            self.packed,
            self.batch_invariant,
        )
        return out.view(*x.shape[:-1], out.shape[1])

    def _float_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as [T, in_features] contiguous float32 rows."""
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        return x2

    def _on_kernels(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the native block kernels (not
        a GPU's split blocks, nor the dequantized GEMM of many rows)."""
        limit = DEQUANTIZE_ABOVE_ROWS if self.dequantize_above is None else self.dequantize_above
        return self._split is None and rows <= limit

    def _numpy_views(self) -> tuple[np.ndarray, np.ndarray | None]:
        # The weight and bias never change after loading: their numpy views
        # are made once (a tied head shares the embedding's bytes).
        if self._views is None:
            bias = None if self.bias is None else self.bias.detach().numpy()
            self._views = (self.weight.detach().numpy(), bias)
        return self._views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._split is not None:
            from ferrox.triton_kernels.quant_matmul import dequant_matmul

            return dequant_matmul(x, self._split, self.bias)
        x2 = self._float_rows(x)
        rows = x2.shape[0]
        if not self._on_kernels(rows):
            out = self._dequantized_matmul(x2)
        else:
            out = torch.empty(rows, self.out_features, dtype=torch.float32)
            quant_matmul_cpu(
                out.numpy(),
                x2.numpy(),
                *self._numpy_views(),
                self.fmt,
                kernel_threads(),
                self.packed,
                self.batch_invariant,
            )
        return out.view(*x.shape[:-1], self.out_features)

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through float32: W dequantized a slice of rows at a time
        into a reused scratch that stays in cache, each slice's GEMM
        written into its columns of the output."""
        n, k = self.out_features, self.in_features
        step = max(1, DEQUANTIZE_CHUNK_ELEMENTS // k)
        if step >= n:
            # On one thread: the kernel pool's workers would still be
            # spinning when torch's threads start the GEMM.
            scratch = _scratch_buffer(n * k).view(n, k)
            weight = dequantize(self.weight, self.fmt, k, scratch, 1, self.packed)
            return _float_linear(x, weight, self.bias)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        scratch = _scratch_buffer(step * k)
        for start in range(0, n, step):
            end = min(n, start + step)
            rows = end - start
            chunk = scratch[: rows * k].view(rows, k)
            dequantize(self.weight, self.fmt, k, chunk, 1, self.packed, range(start, end))
            bias = None if self.bias is None else self.bias[start:end]
            # (F.linear here: oneDNN's op on a new weight slice every call
            # runs several times slower, benches/quant_linear.py's LM head)
            out[:, start:end] = F.linear(x, chunk, bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a block-format table: looked-up rows are
    dequantized (the table doubles as a tied LM head's weight)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.fmt = fmt
        shape = (num_embeddings, row_bytes(fmt, embedding_dim))
        self.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        self._split: SplitBlocks | None = None
        self._dtype = torch.float32
        self.packed = False

    def pack_for_cpu(self, shared: dict[int, nn.Parameter]) -> None:
        """As `QuantLinear.pack_for_cpu` (rows are looked up from the panels)."""
        self.weight = _packed(self.weight, self.fmt, shared)
        self.packed = True

    def split_for_triton(self, shared: dict[int, SplitBlocks], dtype: torch.dtype) -> None:
        """As `QuantLinear.split_for_triton`; rows come out in `dtype`."""
        self._split = _split_weight(self.weight, self.fmt, self.embedding_dim, shared)
        self._dtype = dtype
        self.weight = _released(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        if self._split is not None:
            from ferrox.triton_kernels.quant_matmul import dequantize_split

            rows = dequantize_split(self._split, flat).to(self._dtype)
            return rows.view(*ids.shape, self.embedding_dim)
        out = torch.empty(flat.shape[0], self.embedding_dim, dtype=torch.float32)
        weight = self.weight.numpy()
        dequantize_rows_cpu(out.numpy(), weight, self.fmt, flat.numpy(), 1, self.packed)
        return out.view(*ids.shape, self.embedding_dim)


def _split_weight(
    weight: torch.Tensor, fmt: str, in_features: int, shared: dict[int, SplitBlocks]
) -> SplitBlocks:
    from ferrox.triton_kernels.quant_matmul import split_blocks

    key = weight.data_ptr()
    if key not in shared:
        shared[key] = split_blocks(weight.detach(), fmt, in_features)
    return shared[key]


def _packed(weight: torch.Tensor, fmt: str, shared: dict[int, nn.Parameter]) -> nn.Parameter:
    key = weight.data_ptr()
    if key not in shared:
        shared[key] = nn.Parameter(pack_blocks(weight, fmt), requires_grad=False)
    return shared[key]


def _released(weight: torch.Tensor) -> nn.Parameter:
    """An empty stand-in for blocks no longer read (their memory is freed
    once no module holds them)."""
    return nn.Parameter(weight.new_empty(0), requires_grad=False)
