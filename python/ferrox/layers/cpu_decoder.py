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
formats. A hybrid model's linear-attention layers (Gated DeltaNet,
models/qwen3_5.py) run whole too (`CpuGatedDeltaLayer`,
`ferrox_cpu::gated_delta_layer`) on steps of decodes only (one token a row),
their state read and written in the state pool at the rows' slots; its
attention layers' output gate and partial rotary embedding run inside
`CpuDecoderLayer`. Other steps (prefill, large batches) take the
module-by-module path.

With `batch_invariant` every step takes the native path, prefill included:
each row then goes through the same kernels in the same order whatever the
batch (the block matmul rounds a row alike in any call, the paged attention
reads a query's keys from the cache in block order, rounded as cached, with
its per-query loops), so a request's tokens and logprobs do not depend on
what runs beside it, on chunking or on prefix hits. The price is prefill,
whose attention runs the paged kernel's per-query dot products instead of
one matrix multiply per chunk. (Without it the paged kernel's tile loops
take a block that several queries of a step read, a shared prefix or one
row's queries, for all of them at once: faster, rounded otherwise.)
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from ferrox._native import CpuDecoderLayer, CpuGatedDeltaLayer
from ferrox.common.errors import InvalidArgumentError
from ferrox.layers import quant_linear
from ferrox.layers.attention import cpu_backend
from ferrox.layers.attention.base import AttentionMetadata, KvCache
from ferrox.layers.attention.cpu_backend import SHORT_QUERY_LEN, CpuAttentionBackend
from ferrox.layers.cpu_linear import PackedLinear
from ferrox.layers.gated_delta import state_rows
from ferrox.layers.moe import SparseMoe
from ferrox.layers.native import kernel_threads, kv_array, state_array
from ferrox.layers.quant_linear import QuantLinear

# A Llama-style decoder layer (see models/llama.py): self_attn with a merged
# qkv_proj, o_proj, rotary and a paged-attention backend; mlp with gate_up_proj,
# down_proj and its `activation` ("silu", "gelu_tanh"); `fused_norms()`: the
# input norm, the attention output's norm (Gemma) or None, the MLP's input
# norm, the MLP output's norm (Gemma) or None. `query_gate` on self_attn
# (Qwen3.5): q/k/v's query rows hold each head's query then its output gate.
# A linear-attention layer (models/qwen3_5.py's, `linear` true) has
# linear_attn (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d,
# dt_bias, A_log, norm, out_proj; its head counts and sizes, `tiled`) in
# place of self_attn.
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


# A linear layer as the native layers take it: (weight bytes, bias, format,
# packed).
_Linear = tuple[np.ndarray, np.ndarray | None, str, bool]


def _linear(layer: torch.nn.Module) -> _Linear:
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


def _linear_attention(layer: DecoderLayer) -> Any | None:
    """The layer's Gated DeltaNet mixer, if it is a linear-attention layer."""
    return layer.linear_attn if getattr(layer, "linear", False) else None


def _mlp_fits(layer: DecoderLayer) -> bool:
    """A dense MLP the native layer runs, or experts that run natively."""
    mlp = layer.mlp
    if _dense_mlp(layer):
        return getattr(mlp, "activation", None) in ACTIVATIONS and all(
            _fusable(m) for m in (mlp.gate_up_proj, mlp.down_proj)
        )
    return _native_moe(layer) is not None


def _mlp_linears(layer: DecoderLayer) -> tuple[_Linear | None, _Linear | None]:
    """(gate_up, down) for the native layer: the dense MLP's, or None."""
    if not _dense_mlp(layer):
        return None, None
    return _linear(layer.mlp.gate_up_proj), _linear(layer.mlp.down_proj)


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


# A step with rows of more than SHORT_QUERY_LEN query tokens (which the
# module path would give the paged kernel too) runs fused while it has at
# most this many tokens. One mixed step
# (15 decodes and a prompt's tail behind a cached 700-token prefix, the
# bundled model; `benches/cpu_mixed_steps.py`) ran 1.14-1.25x the module
# path's speed at 35 tokens and 1.05-1.09x at 175 (AVX2, AVX-512 VNNI), and
# within the machine's noise of it from 215: there the module path's
# per-operation overhead is a small share of the step, and what the fused
# layer does on the calling thread alone (the cache writes, Qwen3's head
# norms) weighs as much.
FUSED_MAX_TOKENS_LONG_ROWS = 160


class FusedCpuDecode:
    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = [self._native(layer) for layer in layers]
        self.moes = [_native_moe(layer) for layer in layers]
        linear = [_linear_attention(layer) is not None for layer in layers]
        # A hybrid's steps run here only when every row is a decode.
        self.hybrid = any(linear)
        # A sliding-window layer reads the window pool's tables and slots.
        self.windowed = [
            not is_linear and layer.self_attn.sliding_window is not None
            for layer, is_linear in zip(layers, linear, strict=True)
        ]
        # Each attention layer's rotary table (Gemma's local and global layers
        # differ); a layer without position encoding (`use_rope` False)
        # rotates by cos 1, sin 0: exactly the identity.
        self.tables: list[tuple[np.ndarray, np.ndarray] | None] = []
        for layer, is_linear in zip(layers, linear, strict=True):
            if is_linear:
                self.tables.append(None)
                continue
            rotary = layer.self_attn.rotary
            cos, sin = rotary.cos_cache.numpy(), rotary.sin_cache.numpy()
            identity = (np.ones_like(cos), np.zeros_like(sin))
            self.tables.append((cos, sin) if layer.self_attn.use_rope else identity)
        self.num_threads = kernel_threads()
        self.every_step = False  # `batch_invariant`: prefill too
        # The caches' numpy views, made once for the tensors they view.
        self._cache_tensors: list[torch.Tensor] = []
        self._cache_arrays: list[tuple[np.ndarray, np.ndarray]] = []

    def make_batch_invariant(self, model: Any) -> None:
        """Every step through the native layers, and the LM head's block kernel
        at every row count; refused where a step would still take a path that
        rounds by batch (float weights: the float GEMMs block by row count;
        an MoE router's float GEMM)."""
        if self.hybrid:
            raise InvalidArgumentError(
                "batch_invariant does not run hybrid (linear-attention) models yet: their "
                "prefill runs the chunked delta rule, a decode step the recurrent one"
            )
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
        if getattr(model, "bidirectional_images", False):
            raise InvalidArgumentError(
                "batch_invariant does not run models whose image tokens attend both ways "
                "(Gemma 3 with images) yet: their image rows take the module path's mask"
            )
        if not all(isinstance(linear, QuantLinear) for linear in linears):
            raise InvalidArgumentError(
                "batch_invariant needs block-format weights on the CPU (a GGUF file, or "
                "quantization='q8_0' / 'q4_1'): float GEMMs round differently by batch size"
            )
        for linear in linears:
            assert isinstance(linear, QuantLinear)
            linear.dequantize_above = sys.maxsize
            linear.batch_invariant = True
        self.every_step = True

    @staticmethod
    def supports(layers: list[DecoderLayer]) -> bool:
        def fits(layer: DecoderLayer) -> bool:
            mixer = _linear_attention(layer)
            if mixer is not None:
                return fits_linear(layer, mixer)
            attn = layer.self_attn
            norms = [n for n in layer.fused_norms() if n is not None]
            norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
            return (
                _mlp_fits(layer)
                and all(_fusable(m) for m in (attn.qkv_proj, attn.o_proj))
                and isinstance(attn.attn, CpuAttentionBackend)
                and (attn.q_norm is None) == (attn.k_norm is None)
                and all(n.weight.dtype == torch.float32 for n in norms)
                and len({n.eps for n in norms}) == 1
            )

        def fits_linear(layer: DecoderLayer, mixer: Any) -> bool:
            projections = [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a]
            norms = [layer.input_layernorm, layer.post_attention_layernorm, mixer.norm]
            return (
                _mlp_fits(layer)
                and all(_fusable(m) for m in [*projections, mixer.out_proj])
                and _fp32_cpu(mixer.conv1d.weight, mixer.dt_bias, mixer.A_log)
                and _fp32_cpu(*(n.weight for n in norms))
                and len({n.eps for n in norms}) == 1
            )

        return bool(layers) and all(fits(layer) for layer in layers)

    @staticmethod
    def _native(layer: DecoderLayer) -> CpuDecoderLayer | CpuGatedDeltaLayer:
        mixer = _linear_attention(layer)
        if mixer is not None:
            return FusedCpuDecode._native_linear(layer, mixer)
        attn, mlp = layer.self_attn, layer.mlp
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
            *_mlp_linears(layer),
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.attn.scale,
            head_norms,
            attn.sliding_window or 0,
            output_norms,
            getattr(mlp, "activation", "silu") if _dense_mlp(layer) else "silu",
            None if attn.sinks is None else attn.sinks.detach().float().tolist(),
            attn.query_gate,
            attn.rotary.rotary_dim if attn.use_rope else None,
        )

    @staticmethod
    def _native_linear(layer: DecoderLayer, mixer: Any) -> CpuGatedDeltaLayer:
        def array(t: torch.Tensor) -> np.ndarray:
            return t.detach().contiguous().numpy()

        return CpuGatedDeltaLayer(
            array(layer.input_layernorm.weight),
            array(layer.post_attention_layernorm.weight),
            layer.input_layernorm.eps,
            _linear(mixer.in_proj_qkv),
            _linear(mixer.in_proj_z),
            _linear(mixer.in_proj_b),
            _linear(mixer.in_proj_a),
            array(mixer.conv1d.weight.view(mixer.conv_dim, mixer.conv_kernel)),
            array(mixer.dt_bias),
            array(-mixer.A_log.exp()),  # (as the module path computes it)
            array(mixer.norm.weight),
            _linear(mixer.out_proj),
            *_mlp_linears(layer),
            mixer.num_k_heads,
            mixer.num_v_heads,
            mixer.k_head_dim,
            mixer.v_head_dim,
            mixer.tiled and mixer.num_v_heads != mixer.num_k_heads,
            getattr(layer.mlp, "activation", "silu") if _dense_mlp(layer) else "silu",
        )

    def _step(
        self, meta: AttentionMetadata
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
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
        """Rows whose attention the module path would give the paged kernel
        too (few query tokens; or more, see `cpu_backend`, in a step of at
        most FUSED_MAX_TOKENS_LONG_ROWS tokens), none with image tokens
        (which attend both ways), and few enough tokens that the module path
        would run the block kernel too (not dequantize and GEMM). A
        hybrid's: decodes only."""
        if num_tokens > quant_linear.DEQUANTIZE_ABOVE_ROWS and not self.every_step:
            return False
        if self.hybrid:
            return meta.num_decodes == meta.num_reqs
        if meta.image_spans:  # image tokens attend both ways: the module path masks them
            return False
        if self.every_step or meta.max_query_len <= SHORT_QUERY_LEN:
            return True
        if num_tokens > FUSED_MAX_TOKENS_LONG_ROWS:
            return False
        _, module_rows = meta.row_split(
            cpu_backend.PAGED_FRESH_QUERY_LEN, cpu_backend.SHORT_QUERY_LEN_AFTER_CONTEXT
        )
        return len(module_rows) == 0

    def _arrays(self, kv_caches: list[KvCache]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's cache pair (K and V, or a linear layer's convolution
        and recurrent states) as the native layers take it; the views are
        made again only when the runner passes other tensors."""
        tensors = [t for pair in kv_caches for t in pair]
        same = len(tensors) == len(self._cache_tensors) and all(
            a is b for a, b in zip(tensors, self._cache_tensors, strict=True)
        )
        if not same:
            self._cache_arrays = [
                (a.numpy(), state_array(b))
                if isinstance(layer, CpuGatedDeltaLayer)
                else (kv_array(a), kv_array(b))
                for layer, (a, b) in zip(self.layers, kv_caches, strict=True)
            ]
            self._cache_tensors = tensors
        return self._cache_arrays

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
        res = residual.numpy()
        out = np.zeros_like(res)
        spare: np.ndarray | None = None  # experts' output, then swapped with `out`
        full = self._step(meta)
        window = self._step(meta.window) if meta.window is not None else None
        pos = positions.numpy()
        rows = state_rows(meta) if self.hybrid else None
        for layer, windowed, moe, table, (cache_a, cache_b) in zip(
            self.layers, self.windowed, self.moes, self.tables, self._arrays(kv_caches), strict=True
        ):
            if isinstance(layer, CpuGatedDeltaLayer):  # its state pool
                assert rows is not None
                slots, fresh = rows.decode_slots, rows.decode_fresh
                layer.forward(res, out, cache_a, cache_b, slots, fresh, self.num_threads)
            else:
                step = window if windowed else full
                assert step is not None, "a sliding-window layer needs the window pool's metadata"
                assert table is not None
                cos, sin = table
                layer.forward(
                    res, out, cache_a, cache_b, pos, cos, sin, *step,
                    batch_invariant=self.every_step,
                )  # fmt: skip
            if moe is None:
                continue
            # `out` holds the experts' normed input.
            if moe.native is not None and moe.shared_expert is None:
                if spare is None:
                    spare = np.empty_like(out)
                moe.native.forward(spare, out, self.num_threads)
                out, spare = spare, out
            else:
                moe_in = torch.from_numpy(out)
                moe_in.copy_(moe(moe_in))
        return torch.from_numpy(out), residual
