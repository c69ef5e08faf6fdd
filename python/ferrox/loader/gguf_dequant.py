"""Dequantizing one GGUF tensor into a dense float32 torch tensor.

The common llama.cpp formats (F32, F16, BF16, Q8_0, Q4_0, Q4_1) are unpacked here with vectorised
numpy; every other format goes through `gguf.quants.dequantize`. Both give the same float32 values:
the arithmetic is identical.

NOTE: numpy rather than torch on purpose. These are a few hundred memory-bound element-wise ops,
and torch runs each on its intra-op thread pool: on a small machine that is busy with other work
its threads wait on each other and loading slows down ten-fold. numpy runs them on one thread.
"""

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from ferrox.common.errors import UnsupportedModelError
from ferrox.layers.quant_linear import quantize


@dataclass(frozen=True)
class BlockTensor:
    """A weight kept in a block format the CPU kernels read
    (`ferrox.layers.quant_linear`): `data` is uint8 [out_features, row bytes]."""

    fmt: str  # "q4_1", "q8_0", "q6_k" or "q4_k"
    data: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.in_features)


# GGML types the block kernels run, and the block format each loads into.
BLOCK_FORMATS = {
    GGMLQuantizationType.Q4_0: "q4_1",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q6_K: "q6_k",
    GGMLQuantizationType.MXFP4: "q8_0",
}
MXFP4_BYTES = 17  # 32 values: an e8m0 exponent, 16 bytes of e2m1 codes (low nibbles first)
# e2m1 codes, doubled (the scale is then 2^(e - 128)): the integers of a Q8_0 block.
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
Q4_K_BYTES = 144  # 256 values: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of nibbles


def block_tensor(tensor: ReaderTensor) -> BlockTensor | None:
    """A Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K matrix, or a stack of them (a
    layer's experts: data [experts, rows, row bytes]), as stored (Q4_0
    rewritten as Q4_1 with offset -8 * scale, which is exact; MXFP4 as
    Q8_0); a matrix in another quantized type (Q5_K, Q5_0,
    the IQ formats, ...) requantized to Q8_0 (`requantized`); None for a
    float tensor or a vector."""
    ggml_type = GGMLQuantizationType(tensor.tensor_type)
    shape = [int(n) for n in reversed(tensor.shape.tolist())]
    if len(shape) not in (2, 3):
        return None
    if ggml_type not in BLOCK_FORMATS:
        block_size = GGML_QUANT_SIZES[ggml_type][0]
        return requantized(dequantize_tensor(tensor)) if block_size > 1 else None
    *rows, in_features = shape
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    if ggml_type == GGMLQuantizationType.Q4_0:
        blocks = _blocks(raw, 18)
        scale = blocks[:, :2].view(np.float16)
        out = np.empty((blocks.shape[0], 20), dtype=np.uint8)
        out[:, :2] = blocks[:, :2]
        out[:, 2:4] = (scale * np.float16(-8)).view(np.uint8)
        out[:, 4:] = blocks[:, 2:]
    elif ggml_type == GGMLQuantizationType.MXFP4:
        out = mxfp4_as_q8_0(raw)
    else:
        out = raw.copy()
    data = torch.from_numpy(out.reshape(*rows, -1))
    return BlockTensor(BLOCK_FORMATS[ggml_type], data, in_features)


def q4_k_as_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (256 values: eight sub-blocks of 32, each value
    d * scale_j * q - dmin * min_j with 6-bit scale_j and min_j) as eight
    Q4_1 blocks each (d' q + m'): the same 4-bit q, d' = d * scale_j and
    m' = -dmin * min_j rounded to float16 (a relative 2^-11 at most: the only
    change), where Q4_K is not kept as stored (by default, and for the
    kernels that do not run it: a GPU's, the portable loop).
    [blocks x 144] -> [blocks x 8 x 20]."""
    blocks = raw.reshape(-1, Q4_K_BYTES)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [N, 1]
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16]  # [N, 12]
    low, high = packed[:, :4], packed[:, 8:12]
    scales = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=1)  # [N, 8]
    mins = np.concatenate([packed[:, 4:8] & 63, (high >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1)
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # four groups of 64 values
    values = np.stack((qs & 0x0F, qs >> 4), axis=2).reshape(-1, 8, 32)  # sub-blocks in order
    out = np.empty((blocks.shape[0], 8, 20), dtype=np.uint8)
    out[:, :, 0:2] = (d * scales).astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 2:4] = (-dmin * mins).astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 4:] = values[..., :16] | (values[..., 16:] << 4)
    return out.reshape(-1)


def requantized(weight: torch.Tensor, fmt: str = "q8_0") -> BlockTensor:
    """A float matrix [N, K], or a stack [E, N, K], in `fmt`'s blocks
    (layers/quant_linear.quantize). Formats the block kernels do not run
    come to Q8_0 this way: its rounding (a 255th of each 32 values' largest)
    is finer than theirs (Q6_K: a 63rd of each 16 values' range), so the
    values move by less than their own quantization step; the bytes grow
    (8.5 bits a weight against Q6_K's 6.56)."""
    *rows, k = weight.shape
    data = quantize(weight.reshape(-1, k), fmt)
    return BlockTensor(fmt, data.reshape(*rows, -1), k)


def mxfp4_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """ggml's MXFP4 blocks (32 values e2m1 x 2^(e - 127)) as Q8_0 blocks,
    exactly: the doubled codes as int8, the scale 2^(e - 128) in float16
    (scales below 2^-24, values under 1e-7, become zero). [N x 17] -> [N x 34]."""
    blocks = raw.reshape(-1, MXFP4_BYTES)
    exponent = blocks[:, 0].astype(np.int32) - 128
    if exponent.max(initial=-128) > 15:
        raise UnsupportedModelError("an MXFP4 scale beyond float16's range (2^15)")
    out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
    scale = np.ldexp(np.float32(1), exponent).astype(np.float16)
    out[:, 0:2] = scale[:, None].view(np.uint8)
    codes = blocks[:, 1:]
    values = np.concatenate((codes & 0x0F, codes >> 4), axis=1)  # [N, 32]
    out[:, 2:] = _E2M1_DOUBLED[values].view(np.uint8)
    return out.reshape(-1)


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor as float32 in torch dimension order, in memory of its own (not the file's)."""
    shape = tuple(
        int(n) for n in reversed(tensor.shape.tolist())
    )  # ggml lists the fastest dim first
    ggml_type = GGMLQuantizationType(tensor.tensor_type)
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)  # [num_bytes]
    if ggml_type in _FAST_DEQUANTIZERS:
        values = _FAST_DEQUANTIZERS[ggml_type](raw)
    else:
        values = _dequantize_with_gguf(tensor, ggml_type)
    return torch.from_numpy(values.reshape(shape))


def _dequantize_with_gguf(tensor: ReaderTensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    try:
        values = dequantize(tensor.data, ggml_type)
    except NotImplementedError as exc:
        raise UnsupportedModelError(
            f"tensor {tensor.name!r} uses GGML type {ggml_type.name}, which cannot be dequantized"
        ) from exc
    return np.ascontiguousarray(values, dtype=np.float32)


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float32).copy()


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    # bfloat16 is the upper half of a float32
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(-1, block_bytes)  # [num_blocks, block_bytes]; each block holds 32 values


def _scale(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 scalar at byte `offset` of each block, as float32."""
    return blocks[:, offset : offset + 2].view(np.float16).astype(np.float32)  # [num_blocks, 1]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 values: low nibbles are values 0..15, high nibbles 16..31."""
    nibbles = np.empty((packed.shape[0], 32), dtype=np.uint8)  # [num_blocks, 32]
    np.bitwise_and(packed, 0x0F, out=nibbles[:, :16])
    np.right_shift(packed, 4, out=nibbles[:, 16:])
    return nibbles


def _q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = _blocks(raw, 34)
    quants = blocks[:, 2:].view(np.int8)  # [num_blocks, 32]
    return np.multiply(quants, _scale(blocks, 0), dtype=np.float32)


def _q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = _blocks(raw, 18)
    quants = _nibbles(blocks[:, 2:]).view(np.int8) - np.int8(8)  # [num_blocks, 32]
    return np.multiply(_scale(blocks, 0), quants, dtype=np.float32)


def _q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = _blocks(raw, 20)
    values = np.multiply(_scale(blocks, 0), _nibbles(blocks[:, 4:]), dtype=np.float32)
    values += _scale(blocks, 2)  # [num_blocks, 32]
    return values


_FAST_DEQUANTIZERS = {
    GGMLQuantizationType.F32: _f32,
    GGMLQuantizationType.F16: _f16,
    GGMLQuantizationType.BF16: _bf16,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}
