"""Gemma 3, text only (`Gemma3ForCausalLM`: the 1B model and text
checkpoints): the Llama decoder with

- four norms per layer: the attention output and the MLP output are
  normalised before they join the residual stream, the MLP input has a norm
  of its own (`pre_feedforward_layernorm`);
- RMSNorms that scale by `1 + w`: folded into the weights at load, so the
  layers run ferrox's plain RMSNorm (llama.cpp's GGUF files store `1 + w`
  already);
- RMSNorm on queries and keys, scores scaled by `query_pre_attn_scalar`,
  GeGLU (tanh GELU) MLPs, embeddings multiplied by sqrt(hidden_size);
- interleaved local and global layers (`layer_types`): each kind has its own
  rotary base (and scaling). The local layers attend over a sliding window
  (`models.llama.layer_windows`), their KV in the window pool whose blocks
  behind the window go back while a request runs (docs/architecture.md,
  "Sliding windows"); under an attention backend without windows the
  context is capped at the window, inside which local and global attention
  are the same.

Decode steps on the CPU run fused (layers/cpu_decoder.py: the native
layer takes the two extra norms and the GELU gate). Logit soft-capping
(Gemma 2) and bidirectional attention are refused.

GGUF (llama.cpp's `gemma3`): its files store the norms as `1 + w` and leave
three things to the reader, which this family reads as llama.cpp does: the
layer pattern (`attention.sliding_window_pattern`, default every sixth layer
global), the local rotary base (`rope.freq_base_swa`, default 10000), and
the score scale (head_dim, except the 62-layer 27B model's hidden / heads).
"""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
from torch import nn
from transformers import Gemma3TextConfig

from ferrox.common.errors import UnsupportedModelError
from ferrox.layers.activation import gelu_tanh_and_mul
from ferrox.layers.attention import AttentionBackend, AttentionMetadata
from ferrox.layers.attention.base import KvCache
from ferrox.layers.norm import RMSNorm
from ferrox.layers.rotary import RotaryEmbedding, rope_parameters
from ferrox.models.base import gguf_token_fields, gguf_value
from ferrox.models.llama import DecoderAttention, GatedMlp, LlamaForCausalLM
from ferrox.parallel import state as distributed

LAYER_TYPES = ("sliding_attention", "full_attention")


class GeGluMlp(GatedMlp):
    activation: ClassVar[str] = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x))))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, backend: type[AttentionBackend]):
        super().__init__()
        scale = float(config.query_pre_attn_scalar) ** -0.5
        self.self_attn = DecoderAttention(
            config, rotary, backend, bool(config.attention_bias), qk_norm=True, scale=scale
        )
        self.mlp = GeGluMlp(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [T, hidden]: the previous layer's (normalised) MLP output
        residual: torch.Tensor | None,  # [T, hidden]: the stream before it
        kv: KvCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm.add_forward(residual, x)
        attn = self.post_attention_layernorm(self.self_attn(positions, normed, kv, meta))
        normed, residual = self.pre_feedforward_layernorm.add_forward(residual, attn)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual

    def fused_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        return (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    supports_lora = False  # (not yet verified against peft)
    architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "gemma3"
    gguf_config_class: ClassVar[Any] = Gemma3TextConfig
    gguf_rotary_interleaved: ClassVar[bool] = False

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise UnsupportedModelError(f"Gemma: {name} is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("Gemma: bidirectional attention is not supported")
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or set(types) - set(LAYER_TYPES):
            raise UnsupportedModelError(
                f"Gemma: layer_types must give one of {LAYER_TYPES} per layer, got {types}"
            )
        super().__init__(config, backend)
        self.embed_scale = float(config.hidden_size) ** 0.5

    def decoder_layer(
        self, config: Any, rotary: RotaryEmbedding, backend: type[AttentionBackend], index: int
    ) -> nn.Module:
        return Gemma3DecoderLayer(config, rotary, backend)

    def rotary_tables(self, context_length: int | None) -> list[RotaryEmbedding]:
        """One table per kind of layer (its own base and scaling)."""
        config = self.config
        tables = {
            kind: RotaryEmbedding(
                self.head_dim,
                config.max_position_embeddings,
                rope_parameters(config, kind),
                context_length,
            )
            for kind in set(config.layer_types)
        }
        return [tables[kind] for kind in config.layer_types]

    def decoder_layers(self) -> list[Any]:
        return cast(list[Any], list(self.layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_norms_plus_one(weights))

    # ---- GGUF --------------------------------------------------------------

    @classmethod
    def config_from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> Any:
        def value(key: str, default: Any = None) -> Any:
            return gguf_value(metadata, "gemma3", key, default)

        hidden, heads = int(value("embedding_length")), int(value("attention.head_count"))
        num_layers = int(value("block_count"))
        head_dim = int(value("attention.key_length", 256))
        window = int(value("attention.sliding_window", 0) or 0)
        pattern = value("attention.sliding_window_pattern", 6)
        if not window:
            local = [False] * num_layers
        elif isinstance(pattern, list):
            local = [bool(p) for p in pattern][:num_layers]
        else:
            n = int(pattern)
            local = [n == 0 or i % n < n - 1 for i in range(num_layers)]
        scaling = value("rope.scaling.type", "none")
        global_rope: dict[str, Any] = {"rope_type": "default"}
        if scaling == "linear":
            global_rope = {"rope_type": "linear", "factor": float(value("rope.scaling.factor"))}
        elif scaling != "none":
            raise UnsupportedModelError(f"Gemma 3 GGUF with rope scaling {scaling!r}")
        global_rope["rope_theta"] = float(value("rope.freq_base", 1_000_000.0))
        local_rope = {"rope_type": "default", "rope_theta": float(value("rope.freq_base_swa", 1e4))}
        return Gemma3TextConfig(
            architectures=[cls.architectures[0]],
            vocab_size=value("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
            hidden_size=hidden,
            intermediate_size=int(value("feed_forward_length")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(value("attention.head_count_kv", heads)),
            head_dim=head_dim,
            query_pre_attn_scalar=hidden // heads if num_layers == 62 else head_dim,
            max_position_embeddings=int(value("context_length")),
            rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
            sliding_window=window or None,
            layer_types=["sliding_attention" if w else "full_attention" for w in local],
            rope_parameters={"sliding_attention": local_rope, "full_attention": global_rope},
            final_logit_softcapping=metadata.get("gemma3.final_logit_softcapping"),
            **gguf_token_fields(metadata, tensor_names),
        )

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | {
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }

    @classmethod
    def from_gguf_tensor(cls, name: str, weight: torch.Tensor, config: Any) -> torch.Tensor:
        """llama.cpp stores Gemma's norms as 1 + w: back to the checkpoint's w."""
        return weight - 1 if name.endswith("norm.weight") else weight


def _norms_plus_one(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's RMSNorms scale by 1 + w: ferrox's scale by w."""
    for name, tensor in weights:
        yield name, (tensor + 1 if name.endswith("norm.weight") else tensor)
