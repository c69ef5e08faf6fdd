"""Llama-family decoder (Llama 2/3/3.1, SmolLM, Mistral), also the base of
Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on q and k). Everything ferrox
knows of the family is here: its layers, its weight names (Hugging Face and
llama.cpp's GGUF), how its weights shard, the state its layers keep
(see models/base.py for the contract).

Q, K and V share one projection and so do the MLP's gate and up, so a layer
runs three matmuls instead of five; `load_weights` fills the merged weights
from Hugging Face's separate tensors.

Under tensor parallelism (parallel/state.py) every module is built at its
rank's size: the merged q/k/v and gate/up projections are column-parallel
(this rank's heads and intermediate columns), o_proj and down_proj
row-parallel (their partial sums all-reduced, the bias added by rank 0
only), the embedding and LM head vocab-parallel. `shard_of` says which slice
of each checkpoint tensor a rank loads.
"""

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, cast

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from ferrox.common.errors import ModelLoadError, UnsupportedModelError
from ferrox.common.lora import LoraTargets
from ferrox.layers.activation import gated_projection
from ferrox.layers.attention import AttentionBackend, AttentionMetadata
from ferrox.layers.attention.base import KvCache
from ferrox.layers.cpu_decoder import FusedCpuDecode
from ferrox.layers.lora import LoraSite, LoraSlice
from ferrox.layers.norm import RMSNorm
from ferrox.layers.rotary import RotaryEmbedding, rope_parameters
from ferrox.models.base import (
    CausalLM,
    FullAttention,
    LayerState,
    SlidingWindowAttention,
    gguf_token_fields,
    gguf_value,
)
from ferrox.parallel import state as distributed


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window as transformers applies it: the config's
    `sliding_window` on the layers `layer_types` calls "sliding_attention",
    or on every layer of a config without `layer_types` (Mistral, Phi-3);
    None for full attention."""
    window = int(getattr(config, "sliding_window", None) or 0)
    uses_window = getattr(config, "use_sliding_window", True) is not False
    types = getattr(config, "layer_types", None)
    if not window or not uses_window:
        return [None] * config.num_hidden_layers
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def head_dim_of(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    # Whether q/k/v's query rows hold each head's query then an output gate
    # (models/qwen3_5.py's GatedAttention; read by the CPU's fused decode).
    query_gate: ClassVar[bool] = False

    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        backend: type[AttentionBackend],
        qkv_bias: bool,
        qk_norm: bool,
        scale: float | None = None,
    ) -> None:
        """`scale`: of the attention scores (default head_dim ** -0.5)."""
        super().__init__()
        o_bias = bool(getattr(config, "attention_bias", False))
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shard = distributed.attention_shard(config.num_attention_heads, num_kv_heads)
        self.shard = shard
        self.num_heads = shard.num_heads  # this rank's
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = head_dim_of(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.use_rope = True  # False: a layer without position encoding (NoPE)
        # Attends over the last `sliding_window` positions, in the window
        # pool (`AttentionMetadata.window`); None: full attention.
        self.sliding_window: int | None = None
        # Attention sinks (gpt-oss): this rank's heads' logits; None: none.
        self.sinks: nn.Parameter | None = None
        scale = self.head_dim**-0.5 if scale is None else scale
        self.attn = backend(self.num_heads, self.num_kv_heads, self.head_dim, scale)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: KvCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, self.head_dim)  # [T, H + 2 Hkv, D]
        v = qkv[:, h + hkv :]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + hkv])), dim=1)
        else:
            qk = qkv
        if self.use_rope:
            self.rotary.rotate_(positions, qk, h + hkv)  # queries and keys, in place
        q, k = qk[:, :h], qk[:, h : h + hkv]
        if self.sliding_window is not None:
            assert meta.window is not None, (
                "a sliding-window layer needs the window pool's metadata"
            )
            meta = meta.window
        o = self.attn.forward(q, k, v, kv[0], kv[1], meta, self.sinks)  # [T, H, D]
        return distributed.all_reduce(self.o_proj(o.reshape(t, -1)))


class GatedMlp(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), its intermediate columns split
    over the tensor-parallel ranks (a subclass names another `activation`
    of the gate: Gemma's GeGLU). `intermediate_size`: the whole width
    (default the config's); `reduce`: all-reduce the output (False for an
    expert, whose block sums its experts first)."""

    # (of the gate: `gated_projection`'s and the CPU's fused decode's)
    activation: ClassVar[str] = "silu"

    def __init__(
        self, config: Any, intermediate_size: int | None = None, reduce: bool = True
    ) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        _, inter = distributed.even_shard(width, "intermediate size")
        self.intermediate_size = inter  # this rank's
        self.reduce = reduce
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(gated_projection(self.gate_up_proj, x, self.activation))
        return distributed.all_reduce(out) if self.reduce else out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        backend: type[AttentionBackend],
        qkv_bias: bool,
        qk_norm: bool,
        attention_scale: float | None = None,
    ) -> None:
        """`attention_scale`: of the scores (default head_dim ** -0.5)."""
        super().__init__()
        self.self_attn = DecoderAttention(
            config, rotary, backend, qkv_bias, qk_norm, attention_scale
        )
        self.mlp: nn.Module = GatedMlp(config)  # (a family may put experts here)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [T, hidden]: the previous layer's MLP output
        residual: torch.Tensor | None,  # [T, hidden]: the stream before it
        kv: KvCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual + x is the layer input; its sum with the attention output
        # feeds the MLP. The sums are formed inside the fused add + norm.
        normed, residual = self.input_layernorm.add_forward(residual, x)
        attn = self.self_attn(positions, normed, kv, meta)
        normed, residual = self.post_attention_layernorm.add_forward(residual, attn)
        return self.mlp(normed), residual

    def fused_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        """For the CPU's fused decode (layers/cpu_decoder.py): the input
        norm, the attention output's own norm (none), the MLP's input norm,
        the MLP output's norm (none)."""
        return self.input_layernorm, None, self.post_attention_layernorm, None


class LlamaForCausalLM(CausalLM):
    # Hugging Face `architectures` names this class serves.
    architectures: ClassVar[tuple[str, ...]] = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "LlamaModel",  # an embedding model's base model, without an LM head
        "MistralModel",
        "LlamaForSequenceClassification",  # a classifier's or cross-encoder's head
        "MistralForSequenceClassification",
    )
    qkv_bias = False
    qk_norm = False
    supports_lora = True
    # GGUF: llama.cpp's architecture name, the config class its metadata
    # fills, and whether its converter interleaved the Q/K rows of each head.
    gguf_architecture: ClassVar[str | None] = "llama"
    gguf_config_class: ClassVar[Any] = LlamaConfig
    gguf_rotary_interleaved: ClassVar[bool] = True
    implements_sliding_window: ClassVar[bool] = True
    # Parameters (name prefixes) a subclass's `load_weights` fills itself,
    # outside this loader's checks (a vision tower).
    own_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim_of(config)
        self.vocab_size = int(config.vocab_size)
        self.vocab_start, self.vocab_rows = distributed.vocab_shard(self.vocab_size)
        self.embed_tokens = nn.Embedding(self.vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, rotary, backend, i)
            for i, rotary in enumerate(self.rotary_tables(None))
        )
        if backend.supports_sliding_window:  # (else the context is capped at the window)
            for layer, window in zip(self.decoder_layers(), layer_windows(config), strict=True):
                if window is not None:
                    layer.self_attn.sliding_window = window
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_rows, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
            self._classifier_head(config)
        self.fused_decode: FusedCpuDecode | None = None

    def _classifier_head(self, config: Any) -> None:
        """A sequence classifier's `score` head: from the checkpoint, or (vLLM's
        `classifier_from_token`) from the LM head's rows of those tokens; with
        `is_original_qwen3_reranker`, one label: the "yes" row minus the "no"
        row, so that its sigmoid is the model's p(yes) against p(no)."""
        tokens = getattr(config, "classifier_from_token", None)
        self.score_difference = bool(getattr(config, "is_original_qwen3_reranker", False))
        names = getattr(config, "id2label", None) or {}
        if tokens is not None:
            if not (
                isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)
            ):
                raise ModelLoadError(f"classifier_from_token must list tokens, got {tokens!r}")
            if self.score_difference and len(tokens) != 2:
                raise ModelLoadError(
                    "is_original_qwen3_reranker needs two classifier_from_token: the 'no' and "
                    f"the 'yes' token, got {tokens!r}"
                )
            if distributed.state().size > 1:
                raise ModelLoadError(
                    "classifier_from_token is not supported with tensor parallelism"
                )
            self.score_from_tokens = list(tokens)
            names = dict(enumerate(tokens[1:] if self.score_difference else tokens))
        num_labels = len(names) if tokens is not None else int(getattr(config, "num_labels", 2))
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False)
        self.labels = [str(names.get(i, f"LABEL_{i}")) for i in range(num_labels)]
        self.generates = False

    def derive_score_head(self, token_ids: list[int]) -> None:
        lm_head = self.lm_head
        if type(lm_head) is not nn.Linear:
            raise ModelLoadError(
                "classifier_from_token needs the LM head in float (not in a GGUF file's blocks)"
            )
        rows = lm_head.weight[token_ids]
        if self.score_difference:
            rows = (rows[1] - rows[0])[None]
        head = self._modules["score"]
        assert isinstance(head, nn.Linear)
        with torch.no_grad():
            head.weight.copy_(rows)

    def decoder_layer(
        self, config: Any, rotary: RotaryEmbedding, backend: type[AttentionBackend], index: int
    ) -> nn.Module:
        """Decoder layer `index`, rotating by `rotary`."""
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        scale = self.attention_scale(config)
        return DecoderLayer(config, rotary, backend, qkv_bias, self.qk_norm, scale)

    def attention_scale(self, config: Any) -> float | None:
        """The attention scores' scale; None: head_dim ** -0.5."""
        return None

    def rotary_tables(self, context_length: int | None) -> list[RotaryEmbedding]:
        """Each layer's rotary table, for the engine's `context_length`
        (None: the model's own): here one table that every layer shares."""
        config = self.config
        rotary = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, rope_parameters(config), context_length
        )
        return [rotary] * config.num_hidden_layers

    def prepare_fused_decode(self) -> bool:
        """Once the weights are loaded: run decode steps one native call per
        layer where the layers allow it (block weights, CPU attention)."""
        layers = self.decoder_layers()
        fits = distributed.state().size == 1 and FusedCpuDecode.supports(layers)
        self.fused_decode = FusedCpuDecode(layers) if fits else None
        return self.fused_decode is not None

    def lora_targets(self) -> LoraTargets:
        """q/k/v/o and, in layers with a dense MLP, gate/up/down."""
        config = self.config
        hidden, head_dim = config.hidden_size, head_dim_of(config)
        q = config.num_attention_heads * head_dim
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        modules = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
        }
        if all(isinstance(layer.mlp, GatedMlp) for layer in self.decoder_layers()):
            inter = config.intermediate_size
            modules |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
            modules["down_proj"] = (inter, hidden)
        return LoraTargets(config.num_hidden_layers, modules)

    def lora_sites(self) -> list[LoraSite]:
        sites = []
        for i, layer in enumerate(self.decoder_layers()):
            attn = layer.self_attn
            q, kv, _ = attn.split_sizes
            qkv = (LoraSlice("q_proj", 0, q), LoraSlice("k_proj", q, kv))
            sites.append(LoraSite(i, attn, "qkv_proj", (*qkv, LoraSlice("v_proj", q + kv, kv))))
            hidden = self.config.hidden_size
            sites.append(LoraSite(i, attn, "o_proj", (LoraSlice("o_proj", 0, hidden),)))
            mlp = layer.mlp
            if isinstance(mlp, GatedMlp):
                n = mlp.intermediate_size
                gate_up = (LoraSlice("gate_proj", 0, n), LoraSlice("up_proj", n, n))
                sites.append(LoraSite(i, mlp, "gate_up_proj", gate_up))
                sites.append(LoraSite(i, mlp, "down_proj", (LoraSlice("down_proj", 0, hidden),)))
        return sites

    def layer_states(self) -> list[LayerState]:
        """The per-request state of each layer: paged KV of every position,
        or of the positions inside its sliding window."""
        states: list[LayerState] = []
        for layer in self.decoder_layers():
            attn = layer.self_attn
            if attn.sliding_window is None:
                states.append(FullAttention(attn.num_kv_heads, attn.head_dim))
            else:
                states.append(
                    SlidingWindowAttention(attn.num_kv_heads, attn.head_dim, attn.sliding_window)
                )
        return states

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.first_attention().attn

    def first_attention(self) -> DecoderAttention:
        """The first layer's attention (of a hybrid model: the first
        attention layer's); its shapes are every attention layer's."""
        return self.decoder_layers()[0].self_attn

    def reset_buffers(self, device: torch.device, context_length: int) -> None:
        """After the parameters were materialised from the meta device: the
        buffers (rotary tables, for `context_length`) are built anew on
        `device`, the tied LM head shares the embedding again."""
        with torch.device(device):
            tables = self.rotary_tables(context_length)
        for layer, rotary in zip(self.decoder_layers(), tables, strict=True):
            layer.self_attn.rotary = rotary
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KvCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: in place of the lookup
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        fused = self.fused_decode
        if fused is not None and positions.dim() == 1 and fused.applies(x.shape[0], meta):
            x, stream = fused.run(x, positions, kv_caches, meta)
            return self.norm.add_forward(stream, x)[0]
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv, meta)
        return self.norm.add_forward(residual, x)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if distributed.state().size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start  # this rank's rows; others add zeros
        inside = (local >= 0) & (local < self.vocab_rows)
        x = self.embed_tokens(torch.where(inside, local, 0))
        return distributed.all_reduce(x * inside[:, None].to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab] float32
        logits = self.lm_head(hidden)
        if distributed.state().size > 1:
            logits = distributed.all_gather_last(logits)[:, : self.vocab_size]
        return logits.float()

    def shard_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """The (dim, start, length) slice of checkpoint tensor `name` this
        rank loads, or None for the whole tensor."""
        size = distributed.state().size
        if size == 1:
            return None
        shard = self.first_attention().shard
        d = self.head_dim
        if ".self_attn.q_proj." in name:
            return 0, shard.q_first * d, shard.num_heads * d
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            return 0, shard.kv_first * d, shard.num_kv_heads * d
        if ".self_attn.o_proj.weight" in name:
            return 1, shard.q_first * d, shard.num_heads * d
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return 0, *distributed.even_shard(self.config.intermediate_size, "intermediate size")
        if ".mlp.down_proj.weight" in name:
            return 1, *distributed.even_shard(self.config.intermediate_size, "intermediate size")
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = min(self.vocab_rows, max(0, shape[0] - self.vocab_start))
            return 0, self.vocab_start, rows
        return None

    @staticmethod
    def module_of(name: str) -> str:
        """The module (our name) checkpoint tensor `name` loads into."""
        target, _ = merged_target(name)
        return _param_name(target).removesuffix(".weight").removesuffix(".bias")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors into the (merged) parameters."""
        params = {
            key: param
            for key, param in self.named_parameters(remove_duplicate=False)
            if not key.startswith(self.own_modules)
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, part = merged_target(name)
            key = _param_name(target)
            if key not in params:
                raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint")
            param = params[key]
            tp = distributed.state()
            if tp.rank > 0 and name.endswith((".o_proj.bias", ".down_proj.bias")):
                tensor = torch.zeros_like(tensor)  # row-parallel: rank 0 adds the bias
            with torch.no_grad():
                dst = self._slice_for(param, target, part)
                if tp.size > 1 and key in ("embed_tokens.weight", "lm_head.weight"):
                    dst.zero_()  # the last rank's rows beyond the vocabulary stay zero
                    dst = dst.narrow(0, 0, min(tensor.shape[0], dst.shape[0]))
                if dst.shape != tensor.shape:
                    raise ModelLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
            loaded.add(key if part is None else f"{key}#{part}")
        self._check_complete(params, loaded)

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    def _slice_for(self, param: torch.Tensor, target: str, part: str | None) -> torch.Tensor:
        if part is None:
            return param
        attn = self.first_attention()
        if ".qkv_proj" in target:
            sizes = attn.split_sizes
            index = "qkv".index(part)
        else:  # gate/up: two equal halves (a dense MLP's or an expert's)
            sizes = [param.shape[0] // 2] * 2
            index = ("gate", "up").index(part)
        start = sum(sizes[:index])
        return param.narrow(0, start, sizes[index])

    def _check_complete(self, params: Mapping[str, torch.Tensor], loaded: set[str]) -> None:
        """Every parameter was loaded; but for the LM head of a base model's
        checkpoint (an embedding model's), which then serves embeddings only."""
        if self.score_from_tokens:
            loaded = loaded | {"score.weight"}  # made from LM-head rows after loading
        if "lm_head.weight" not in loaded and not self.tie_word_embeddings:
            others = [k for k in loaded if k != "lm_head.weight"]
            if others and all(not k.startswith("lm_head.") for k in loaded):
                self.generates = False
                with torch.no_grad():
                    params["lm_head.weight"].zero_()
                loaded = loaded | {"lm_head.weight"}
        missing = []
        for key in params:
            if key in loaded or (key == "lm_head.weight" and self.tie_word_embeddings):
                continue  # (a merged parameter may come whole: Phi-3's fused tensors)
            if ".qkv_proj." in key:
                parts = [f"{key}#{p}" for p in "qkv"]
            elif ".gate_up_proj." in key:
                parts = [f"{key}#{p}" for p in ("gate", "up")]
            else:
                parts = [key]
            missing += [p for p in parts if p not in loaded]
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    # ---- GGUF (llama.cpp's names and metadata) ------------------------------

    @classmethod
    def config_from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> PretrainedConfig:
        """The Hugging Face config a GGUF file's metadata describes."""
        arch = cls.gguf_architecture
        assert arch is not None

        def value(key: str, default: Any = None) -> Any:
            return gguf_value(metadata, arch, key, default)

        hidden_size = value("embedding_length")
        num_heads = value("attention.head_count")
        num_kv_heads = value("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):
            raise UnsupportedModelError(
                "GGUF files with a per-layer KV head count are not supported"
            )
        head_dim = value("attention.key_length", hidden_size // num_heads)
        if value("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        if value("rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
            raise UnsupportedModelError("GGUF files with RoPE scaling are not supported yet")
        return cls.gguf_config_class(
            architectures=[cls.architectures[0]],
            vocab_size=value("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
            hidden_size=hidden_size,
            intermediate_size=value("feed_forward_length"),
            num_hidden_layers=value("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=value("context_length"),
            rope_theta=float(value("rope.freq_base", 10000.0)),
            rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
            **gguf_token_fields(metadata, tensor_names),
            **cls._gguf_config_extra(metadata, tensor_names),
        )

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        """Config fields of this family beyond the common ones (what the
        tensors tell, or metadata of the family's own)."""
        return {
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        }

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        """llama.cpp's per-layer tensor stems -> our checkpoint module names."""
        return _GGUF_LAYER_TENSORS

    @classmethod
    def checkpoint_name(cls, gguf_name: str) -> str:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
        stem, _, suffix = gguf_name.rpartition(".")
        if suffix in ("weight", "bias"):
            if stem in _GGUF_GLOBAL_TENSORS:
                return f"{_GGUF_GLOBAL_TENSORS[stem]}.{suffix}"
            block, _, rest = stem.partition(".")
            layer, _, part = rest.partition(".")
            layer_tensors = cls.gguf_layer_tensors()
            if block == "blk" and layer.isdigit() and part in layer_tensors:
                return f"model.layers.{layer}.{layer_tensors[part]}.{suffix}"
        raise UnsupportedModelError(
            f"GGUF tensor {gguf_name!r} has no counterpart in {cls.architectures[0]}"
        )

    @classmethod
    def from_gguf_tensor(
        cls, name: str, weight: torch.Tensor, config: PretrainedConfig
    ) -> torch.Tensor:
        """A GGUF tensor (dense, or block rows) as the checkpoint's `name`
        holds it: for Llama, llama.cpp's converter reordered the Q and K rows
        of each head from the half-split rotary layout to the interleaved
        one; this puts them back."""
        if not cls.gguf_rotary_interleaved:
            return weight
        if ".q_proj." in name:
            return _unpermute_rotary_rows(weight, config.num_attention_heads)
        if ".k_proj." in name:
            return _unpermute_rotary_rows(weight, config.num_key_value_heads)
        return weight


_GGUF_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order: rows (j, 0), (j, 1) for j < half -> (0, j), (1, j)."""
    rows = weight.shape[0]  # num_heads * head_dim
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # [heads, half, 2, ...]
    return per_head.transpose(1, 2).reshape(weight.shape)  # [heads * 2 * half, ...]


_MERGED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    # a layer's MLP (`mlp.gate_proj`) or one of its experts' (`mlp.experts.3.gate_proj`)
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


def merged_target(name: str) -> tuple[str, str | None]:
    for src, (dst, part) in _MERGED.items():
        if src in name:
            return name.replace(src, dst), part
    return name, None


def _param_name(hf_name: str) -> str:
    # HF nests the decoder under `model.`; ours sits at the top level.
    return hf_name.removeprefix("model.")
