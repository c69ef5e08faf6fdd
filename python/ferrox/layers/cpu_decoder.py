"""Decode steps on the CPU, one native call per decoder layer.

When every linear layer of a Llama-family model holds block-format weights
(`QuantLinear`) or float32 ones it can read as they are (a plain `nn.Linear`,
or a `PackedLinear` small enough to keep its plain weight too: a tiny or draft
model), and attention runs on the CPU backend in float32, a step whose
rows each have a few query tokens (decodes, short speculative verifications)
runs each layer whole in Rust (`CpuDecoderLayer`, `ferrox_cpu::decoder_layer`):
the same kernels the layer calls one at a time, without the twenty-odd tensor
operations per layer that cost more than the arithmetic at one token a step.
Qwen3's per-head q/k norms run inside the call too. A mixture-of-experts
layer (layers/moe.py) runs its attention half in that call and its experts
in a second native one (`CpuMoeExperts`), where its experts are in block
formats. Other steps (prefill, large batches) take the module-by-module path.

With `batch_invariant` every step takes the native path, prefill included:
each row then goes through the same kernels in the same order whatever the
batch (the block matmul rounds a row alike in any call, the paged attention
reads a query's keys from the cache in block order, rounded as cached), so a
request's tokens and logprobs do not depend on what runs beside it, on
chunking or on prefix hits. The price is prefill, whose attention runs the
paged kernel's per-query dot products instead of one matrix multiply per
chunk.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from ferrox._native import CpuDecoderLayer
from ferrox.common.errors import InvalidArgumentError
from ferrox.layers import quant_linear
from ferrox.layers.attention.base import AttentionMetadata, KvCache
from ferrox.layers.attention.cpu_backend import SHORT_QUERY_LEN, CpuAttentionBackend
from ferrox.layers.cpu_linear import PackedLinear
from ferrox.layers.moe import SparseMoe
from ferrox.layers.native import kernel_threads, kv_array
from ferrox.layers.quant_linear import QuantLinear

# A Llama-style decoder layer (see models/llama.py): self_attn with a merged
# qkv_proj, o_proj, rotary and a paged-attention backend; mlp with gate_up_proj,
# down_proj and its `activation` ("silu", "gelu_tanh"); `fused_norms()`: the
# input norm, the attention output's norm (Gemma) or None, the MLP's input
# norm, the MLP output's norm (Gemma) or None.
DecoderLayer = Any
ACTIVATIONS = ("silu", "gelu_tanh")


def _float_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """The float32 [N, K] weight the fused layer can read, if any."""
    if isinstance(layer, PackedLinear):
        weight = layer.plain
    elif type(layer) is torch.nn.Linear:
        weight = layer.weight.detach()
    else:
        return None
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return weight.contiguous()


def _fusable(layer: torch.nn.Module) -> bool:
    return isinstance(layer, QuantLinear) or _float_weight(layer) is not None


def _linear(layer: torch.nn.Module) -> tuple:
    bias_tensor: torch.Tensor | None = getattr(layer, "bias", None)
    bias = None if bias_tensor is None else bias_tensor.detach().numpy()
    if isinstance(layer, QuantLinear):
        return layer.weight.detach().numpy(), bias, layer.fmt, layer.packed
    weight = _float_weight(layer)
    assert weight is not None
    return weight.numpy().view(np.uint8), bias, "f32", False


def _dense_mlp(layer: DecoderLayer) -> bool:
    return hasattr(layer.mlp, "gate_up_proj") and hasattr(layer.mlp, "down_proj")


def _native_moe(layer: DecoderLayer) -> SparseMoe | None:
    """The layer's MoE block, if its experts run natively."""
    mlp = layer.mlp
    return mlp if isinstance(mlp, SparseMoe) and mlp.native is not None else None


class FusedCpuDecode:
    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = [self._native(layer) for layer in layers]
        self.moes = [_native_moe(layer) for layer in layers]
        # A sliding-window layer reads the window pool's tables and slots.
        self.windowed = [layer.self_attn.sliding_window is not None for layer in layers]
        # Each layer's rotary table (Gemma's local and global layers differ);
        # a layer without position encoding (`use_rope` False) rotates by
        # cos 1, sin 0: exactly the identity.
        self.tables = []
        for layer in layers:
            rotary = layer.self_attn.rotary
            cos, sin = rotary.cos_cache.numpy(), rotary.sin_cache.numpy()
            identity = (np.ones_like(cos), np.zeros_like(sin))
            self.tables.append((cos, sin) if layer.self_attn.use_rope else identity)
        self.num_threads = kernel_threads()
        self.every_step = False  # `batch_invariant`: prefill too

    def make_batch_invariant(self, model: Any) -> None:
        """Every step through the native layers, and the LM head's block kernel
        at every row count; refused where a step would still take a path that
        rounds by batch (float weights: the float GEMMs block by row count;
        an MoE router's float GEMM)."""
        layers: list[DecoderLayer] = model.decoder_layers()
        linears = [model.lm_head]
        for layer in layers:
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj] if _dense_mlp(layer) else []
        if any(moe is not None for moe in self.moes) or not all(_dense_mlp(x) for x in layers):
            raise InvalidArgumentError(
                "batch_invariant does not run mixture-of-experts models yet (the router's "
                "float GEMM rounds by batch size)"
            )
        if not all(isinstance(linear, QuantLinear) for linear in linears):
            raise InvalidArgumentError(
                "batch_invariant needs block-format weights on the CPU (a GGUF file, or "
                "quantization='q8_0' / 'q4_1'): float GEMMs round differently by batch size"
            )
        for linear in linears:
            assert isinstance(linear, QuantLinear)
            linear.dequantize_above = sys.maxsize
        self.every_step = True

    @staticmethod
    def supports(layers: list[DecoderLayer]) -> bool:
        def fits(layer: DecoderLayer) -> bool:
            attn, mlp = layer.self_attn, layer.mlp
            dense = _dense_mlp(layer)
            linears = [attn.qkv_proj, attn.o_proj]
            linears += [mlp.gate_up_proj, mlp.down_proj] if dense else []
            norms = [n for n in layer.fused_norms() if n is not None]
            norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
            return (
                (
                    (dense and getattr(mlp, "activation", None) in ACTIVATIONS)
                    or _native_moe(layer) is not None
                )
                and all(_fusable(m) for m in linears)
                and isinstance(attn.attn, CpuAttentionBackend)
                and (attn.q_norm is None) == (attn.k_norm is None)
                and all(n.weight.dtype == torch.float32 for n in norms)
                and len({n.eps for n in norms}) == 1
            )

        return bool(layers) and all(fits(layer) for layer in layers)

    @staticmethod
    def _native(layer: DecoderLayer) -> CpuDecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        dense = _dense_mlp(layer)
        head_norms = (
            None
            if attn.q_norm is None
            else (attn.q_norm.weight.detach().numpy(), attn.k_norm.weight.detach().numpy())
        )
        input_norm, attention_out, mlp_in, mlp_out = layer.fused_norms()
        output_norms = (
            None
            if attention_out is None or mlp_out is None
            else (attention_out.weight.detach().numpy(), mlp_out.weight.detach().numpy())
        )
        return CpuDecoderLayer(
            input_norm.weight.detach().numpy(),
            mlp_in.weight.detach().numpy(),
            input_norm.eps,
            _linear(attn.qkv_proj),
            _linear(attn.o_proj),
            _linear(mlp.gate_up_proj) if dense else None,
            _linear(mlp.down_proj) if dense else None,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.attn.scale,
            head_norms,
            attn.sliding_window or 0,
            output_norms,
            getattr(mlp, "activation", "silu") if dense else "silu",
            None if attn.sinks is None else attn.sinks.detach().float().tolist(),
        )

    def _step(self, meta: AttentionMetadata) -> tuple:
        """The step arrays one pool's layers read."""
        block_table = (
            meta.block_table_cpu if meta.block_table_cpu is not None else meta.block_table.numpy()
        )
        return (
            meta.slot_mapping.numpy(),
            block_table,
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            self.num_threads,
        )

    def applies(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Rows of few query tokens, and few enough tokens that the module
        path would run the block kernel too (not dequantize and GEMM)."""
        return self.every_step or (
            meta.max_query_len <= SHORT_QUERY_LEN
            and num_tokens <= quant_linear.DEQUANTIZE_ABOVE_ROWS
        )

    def run(
        self,
        x: torch.Tensor,  # [T, hidden]: the embeddings
        positions: torch.Tensor,
        kv_caches: list[KvCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it)."""
        # The first layer's input is the embeddings: as a residual stream
        # plus a zero delta, every layer has the same form.
        residual = x.contiguous()
        x = torch.zeros_like(residual)
        full = self._step(meta)
        window = self._step(meta.window) if meta.window is not None else None
        res, out = residual.numpy(), x.numpy()
        pos = positions.numpy()
        for layer, windowed, moe, (cos, sin), (k_cache, v_cache) in zip(
            self.layers, self.windowed, self.moes, self.tables, kv_caches, strict=True
        ):
            step = window if windowed else full
            assert step is not None, "a sliding-window layer needs the window pool's metadata"
            layer.forward(res, out, kv_array(k_cache), kv_array(v_cache), pos, cos, sin, *step)
            if moe is not None:  # `x` holds the experts' normed input
                x.copy_(moe(x))
        return x, residual
