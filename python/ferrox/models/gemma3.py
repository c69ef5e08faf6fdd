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
  rotary base (and scaling). The local layers attend over a sliding window;
  ferrox does not implement windows yet, so the context is capped at the
  window (`loader.model_loader.resolve_max_model_len`), inside which local
  and global attention are the same.

Layers run on the module path (the CPU's fused decode chains Llama's layer
shape). Logit soft-capping (Gemma 2) and bidirectional attention are
refused.
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
from ferrox.models.llama import DecoderAttention, GatedMlp, LlamaForCausalLM
from ferrox.parallel import state as distributed

LAYER_TYPES = ("sliding_attention", "full_attention")


class GeGluMlp(GatedMlp):
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


class Gemma3ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",)
    gguf_architecture: ClassVar[str | None] = None
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
        nn.Module.__init__(self)
        self.config = config
        self.layer_types = types
        self.head_dim = int(config.head_dim)
        self.vocab_size = int(config.vocab_size)
        self.vocab_start, self.vocab_rows = distributed.vocab_shard(self.vocab_size)
        self.rotaries = self._rotaries(None)
        self.embed_tokens = nn.Embedding(self.vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, self.rotaries[kind], backend) for kind in types
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_rows, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = self.rotaries["full_attention"]
        self.fused_decode = None
        self.embed_scale = float(config.hidden_size) ** 0.5

    def _rotaries(self, context_length: int | None) -> dict[str, RotaryEmbedding]:
        """One rotary table per kind of layer (its own base and scaling)."""
        return {
            kind: RotaryEmbedding(
                self.head_dim,
                self.config.max_position_embeddings,
                rope_parameters(self.config, kind),
                context_length,
            )
            for kind in LAYER_TYPES
        }

    def reset_buffers(self, device: torch.device, context_length: int) -> None:
        with torch.device(device):
            self.rotaries = self._rotaries(context_length)
        self.rotary = self.rotaries["full_attention"]
        for layer, kind in zip(self.decoder_layers(), self.layer_types, strict=True):
            layer.self_attn.rotary = self.rotaries[kind]
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prepare_fused_decode(self) -> bool:
        self.fused_decode = None  # the fused decode chains Llama's layer shape
        return False

    def decoder_layers(self) -> list[Any]:
        return cast(list[Any], list(self.layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_norms_plus_one(weights))


def _norms_plus_one(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's RMSNorms scale by 1 + w: ferrox's scale by w."""
    for name, tensor in weights:
        yield name, (tensor + 1 if name.endswith("norm.weight") else tensor)
