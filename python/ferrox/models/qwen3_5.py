"""Qwen3.5 (text): a hybrid decoder. Of every `full_attention_interval`
layers (`layer_types`), all but the last are Gated DeltaNet linear attention
(layers/gated_delta.py), whose per-sequence state is a fixed size and lives
in the state pool (one slot per running sequence, given by the Rust
scheduler); the last is attention with a paged KV cache:

- linear layers: x -> in_proj_qkv (queries, keys, values), in_proj_z (the
  output gate), in_proj_b (step sizes, through a sigmoid), in_proj_a (decays:
  g = -exp(A_log) * softplus(a + dt_bias)); a depthwise causal convolution
  and SiLU over q, k, v; the gated delta rule; per head an RMSNorm times
  SiLU(z); out_proj.
- attention layers: q_proj gives each head's query and an output gate
  (sigmoid, after attention); q/k RMSNorms; rotary embedding on the first
  `partial_rotary_factor` of each head (M-RoPE's three position streams are
  one for text, which is plain RoPE).
- RMSNorms scale by `1 + w` (folded into the weights at load), except the
  linear layers' gated norm; SwiGLU MLPs as Llama's.

Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`) has in every layer, in place of the
MLP, a mixture of experts (layers/moe.py: softmax router, top-k weights
renormalised) plus a shared expert behind a sigmoid gate. Qwen3-Next
(models/qwen3_next.py) is the same decoder with fused input projections.

Hybrid models run without the prefix cache (a cached prefix holds KV only,
not the state of the tokens it covers), without speculative decoding (the
state cannot roll back a rejected draft), on one rank, without CUDA graphs
and without the CPU's fused decode. Text only: `Qwen3_5ForCausalLM`; the
vision-language checkpoints (`Qwen3_5ForConditionalGeneration`) are refused.
"""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.common.errors import UnsupportedModelError
from ferrox.layers.attention import AttentionBackend, AttentionMetadata
from ferrox.layers.attention.base import KvCache
from ferrox.layers.gated_delta import causal_conv1d, gated_delta_rule, gated_rms_norm
from ferrox.layers.moe import SparseMoe
from ferrox.layers.norm import RMSNorm
from ferrox.layers.rotary import RotaryEmbedding, rope_parameters
from ferrox.models.base import FullAttention, LayerState, LinearAttentionState
from ferrox.models.llama import DecoderAttention, GatedMlp, LlamaForCausalLM
from ferrox.parallel import state as distributed

LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(DecoderAttention):
    """Attention whose query projection also gives, per head, a gate on the
    attention output (sigmoid)."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, backend: type[AttentionBackend]):
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary, backend, qkv_bias=bias, qk_norm=True)
        q, kv, _ = self.split_sizes
        self.split_sizes = [2 * q, kv, kv]  # each head's query then its gate
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * q + 2 * kv, bias=bias)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: KvCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        query_gate = qkv[:, : 2 * h * d].view(t, h, 2 * d)
        gate = query_gate[:, :, d:].reshape(t, h * d)
        k = qkv[:, 2 * h * d : (2 * h + hkv) * d].reshape(t, hkv, d)
        v = qkv[:, (2 * h + hkv) * d :].reshape(t, hkv, d)
        assert self.q_norm is not None and self.k_norm is not None
        qk = torch.cat((self.q_norm(query_gate[:, :, :d]), self.k_norm(k)), dim=1)
        self.rotary.rotate_(positions, qk, h + hkv)
        o = self.attn.forward(qk[:, :h], qk[:, h:], v, kv[0], kv[1], meta)  # [T, H, D]
        return self.o_proj(o.reshape(t, h * d) * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (see the module's docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_k_heads = int(config.linear_num_key_heads)
        self.num_v_heads = int(config.linear_num_value_heads)
        self.k_head_dim = int(config.linear_key_head_dim)
        self.v_head_dim = int(config.linear_value_head_dim)
        if self.num_v_heads % self.num_k_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        self.key_dim = self.num_k_heads * self.k_head_dim
        self.value_dim = self.num_v_heads * self.v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = int(config.linear_conv_kernel_dim)
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNorm(self.v_head_dim, config.rms_norm_eps)  # its weight, not 1 + w
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def state(self) -> LinearAttentionState:
        return LinearAttentionState(
            self.conv_dim, self.conv_kernel, self.num_v_heads, self.k_head_dim, self.v_head_dim
        )

    def forward(self, x: torch.Tensor, state: KvCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        conv_states, recurrent_states = state
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel).float()
        qkv = causal_conv1d(self.in_proj_qkv(x), weight, conv_states, meta)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=1)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        a = self.in_proj_a(x).float()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        o = gated_delta_rule(
            q.reshape(t, self.num_k_heads, self.k_head_dim),
            k.reshape(t, self.num_k_heads, self.k_head_dim),
            v.reshape(t, self.num_v_heads, self.v_head_dim),
            g,
            beta,
            recurrent_states,
            meta,
        ).to(x.dtype)
        z = self.in_proj_z(x).view(t, self.num_v_heads, self.v_head_dim)
        o = gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        return self.out_proj(o.reshape(t, self.value_dim))


class HybridDecoderLayer(nn.Module):
    """A decoder layer whose token mixer is linear attention (`linear_attn`)
    or attention (`self_attn`), then an MLP; pre-norm residual blocks."""

    def __init__(self, config: Any, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.linear = isinstance(mixer, GatedDeltaNet)
        self.add_module("linear_attn" if self.linear else "self_attn", mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        module = self._modules["linear_attn" if self.linear else "self_attn"]
        assert module is not None
        return module

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv: KvCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm.add_forward(residual, x)
        mixer = self.mixer
        if isinstance(mixer, GatedDeltaNet):
            mixed = mixer(normed, kv, meta)
        else:
            mixed = mixer(positions, normed, kv, meta)
        normed, residual = self.post_attention_layernorm.add_forward(residual, mixed)
        return self.mlp(normed), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3_5ForCausalLM",)
    supports_lora = False
    supports_cuda_graphs: ClassVar[bool] = False
    gguf_architecture: ClassVar[str | None] = None
    implements_sliding_window: ClassVar[bool] = False

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or set(types) - set(LAYER_TYPES):
            raise UnsupportedModelError(
                f"Qwen3.5: layer_types must give one of {LAYER_TYPES} per layer, got {types}"
            )
        if "full_attention" not in types:
            raise UnsupportedModelError("Qwen3.5: a model without attention layers")
        if distributed.state().size > 1:
            raise UnsupportedModelError(
                "Qwen3.5 (linear-attention layers) does not run under tensor parallelism yet"
            )
        super().__init__(config, backend)

    def decoder_layer(
        self, config: Any, rotary: RotaryEmbedding, backend: type[AttentionBackend], index: int
    ) -> nn.Module:
        mixer: nn.Module
        if config.layer_types[index] == "linear_attention":
            mixer = GatedDeltaNet(config)
        else:
            mixer = GatedAttention(config, rotary, backend)
        return HybridDecoderLayer(config, mixer, self.mlp_of(config, index))

    def mlp_of(self, config: Any, index: int) -> nn.Module:
        """Layer `index`'s MLP (a family with experts overrides this)."""
        return GatedMlp(config)

    def rotary_tables(self, context_length: int | None) -> list[RotaryEmbedding]:
        config = self.config
        params = rope_parameters(config)
        rotary = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, params, context_length, partial=True
        )
        return [rotary] * config.num_hidden_layers

    def attention_layers(self) -> list[HybridDecoderLayer]:
        return [layer for layer in self.hybrid_layers() if not layer.linear]

    def hybrid_layers(self) -> list[HybridDecoderLayer]:
        return cast(list[HybridDecoderLayer], list(self.layers))

    def first_attention(self) -> DecoderAttention:
        return cast(DecoderAttention, self.attention_layers()[0].self_attn)

    def layer_states(self) -> list[LayerState]:
        states: list[LayerState] = []
        for layer in self.hybrid_layers():
            if layer.linear:
                states.append(cast(GatedDeltaNet, layer.linear_attn).state())
            else:
                attn = cast(DecoderAttention, layer.self_attn)
                states.append(FullAttention(attn.num_kv_heads, attn.head_dim))
        return states

    def reset_buffers(self, device: torch.device, context_length: int) -> None:
        with torch.device(device):
            (rotary, *_) = self.rotary_tables(context_length)
        for layer in self.attention_layers():
            cast(DecoderAttention, layer.self_attn).rotary = rotary
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prepare_fused_decode(self) -> bool:
        self.fused_decode = None
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_norms_plus_one(weights))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3_5MoeForCausalLM",)

    def mlp_of(self, config: Any, index: int) -> nn.Module:
        return self.sparse_moe(config, renormalize=True)

    @staticmethod
    def sparse_moe(config: Any, renormalize: bool) -> SparseMoe:
        """Routed experts plus the shared expert (when the config has one)."""
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"{config.model_type} with hidden_act={hidden_act!r}")
        width = int(config.moe_intermediate_size)
        moe = SparseMoe(
            config.hidden_size,
            int(config.num_experts),
            int(config.num_experts_per_tok),
            renormalize,
            lambda: GatedMlp(config, width, reduce=False),
        )
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        if shared:
            moe.add_shared_expert(GatedMlp(config, shared, reduce=False))
        return moe

    def prepare_fused_decode(self) -> bool:
        """Block-format experts on the CPU run natively (layers/moe.py); the
        layers themselves run module by module."""
        for layer in self.hybrid_layers():
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.prepare_native()
        return super().prepare_fused_decode()


# The norms that scale by 1 + w (the linear layers' gated norm scales by w).
_PLUS_ONE_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def _norms_plus_one(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with the 1 + w norms folded, and without the
    multi-token-prediction head's."""
    for name, tensor in weights:
        if name.startswith("mtp."):
            continue  # the multi-token-prediction head (ferrox does not run it)
        plus_one = name.endswith(_PLUS_ONE_NORMS) or name in ("model.norm.weight", "norm.weight")
        yield name, (tensor + 1 if plus_one else tensor)
