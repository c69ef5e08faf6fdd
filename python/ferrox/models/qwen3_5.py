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

Prefix caching resumes such a model from state snapshots
(docs/architecture.md, "Recurrent state"). Hybrid models run without
speculative decoding (the state cannot roll back a rejected draft), on one
rank, without CUDA graphs. On the CPU a step of decodes runs each layer in
one native call (layers/cpu_decoder.py), the linear layers with their state
pool, as the dense families' decode steps do. The
vision-language checkpoints (`Qwen3_5ForConditionalGeneration`, and its MoE
relative) are this decoder under a vision tower (models/qwen3_vl.py).

GGUF (llama.cpp's `qwen35` / `qwen35moe`, and `qwen3next`): the linear
layers' tensors are `attn_qkv`, `attn_gate` (z), `ssm_beta`, `ssm_alpha`,
`ssm_a` (stored as -exp(A_log)), `ssm_dt.bias`, `ssm_conv1d` (squeezed),
`ssm_norm`, `ssm_out`; the 1 + w norms are stored as 1 + w. llama.cpp's
converter puts Qwen3.5's value heads in tiled order (value head j of key
head g at position j * key_heads + g, so that ggml broadcasts the key heads)
in every tensor indexed by value head; the layer reads that order as it is
(`GatedDeltaNet.tiled`: key head h % key_heads for value head h) rather
than permuting the weights back.
"""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from ferrox.common.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.attention import AttentionBackend, AttentionMetadata
from ferrox.layers.attention.base import KvCache
from ferrox.layers.gated_delta import causal_conv1d, gated_delta_rule, gated_rms_norm
from ferrox.layers.moe import SparseMoe
from ferrox.layers.norm import RMSNorm
from ferrox.layers.rotary import RotaryEmbedding, rope_parameters
from ferrox.models.base import (
    FullAttention,
    LayerState,
    LinearAttentionState,
    gguf_token_fields,
    gguf_value,
)
from ferrox.models.llama import DecoderAttention, GatedMlp, LlamaForCausalLM
from ferrox.models.qwen3_moe import split_stacked_experts
from ferrox.parallel import state as distributed

LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(DecoderAttention):
    """Attention whose query projection also gives, per head, a gate on the
    attention output (sigmoid)."""

    query_gate: ClassVar[bool] = True

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
        # Value heads in llama.cpp's tiled order (value head h reads key
        # head h % key_heads) instead of grouped (h // (value / key heads)).
        self.tiled = bool(getattr(config, "linear_value_heads_tiled", False))

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
        q = q.reshape(t, self.num_k_heads, self.k_head_dim)
        k = k.reshape(t, self.num_k_heads, self.k_head_dim)
        if self.tiled and self.num_v_heads != self.num_k_heads:
            groups = self.num_v_heads // self.num_k_heads
            q, k = q.repeat(1, groups, 1), k.repeat(1, groups, 1)  # (then one per value head)
        o = gated_delta_rule(
            q,
            k,
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

    def fused_norms(self) -> tuple[RMSNorm, None, RMSNorm, None]:
        """As `DecoderLayer.fused_norms` (layers/cpu_decoder.py)."""
        return self.input_layernorm, None, self.post_attention_layernorm, None


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3_5ForCausalLM",)
    supports_lora = False
    supports_cuda_graphs: ClassVar[bool] = False
    implements_sliding_window: ClassVar[bool] = False
    gguf_architecture: ClassVar[str | None] = "qwen35"
    gguf_config_class: ClassVar[Any] = Qwen3_5TextConfig
    gguf_rotary_interleaved: ClassVar[bool] = False
    # Whether llama.cpp's converter tiles the value heads of this family.
    gguf_tiles_value_heads: ClassVar[bool] = True

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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_norms_plus_one(weights))

    # ---- GGUF --------------------------------------------------------------

    @classmethod
    def config_from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> Any:
        arch = cls.gguf_architecture
        assert arch is not None

        def value(key: str, default: Any = None) -> Any:
            return gguf_value(metadata, arch, key, default)

        num_layers = int(value("block_count"))
        recurrent = value("attention.recurrent_layers", [])
        if recurrent:
            linear = [bool(r) for r in recurrent][:num_layers]
        else:
            interval = int(value("full_attention_interval", 4))
            linear = [(i + 1) % interval != 0 for i in range(num_layers)]
        heads = int(value("attention.head_count"))
        kv_heads = value("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise UnsupportedModelError("GGUF files with a per-layer KV head count")
        head_dim = int(value("attention.key_length"))
        v_heads = int(value("ssm.time_step_rank"))
        if value("rope.scaling.type", "none") != "none":
            raise UnsupportedModelError(f"{arch} GGUF with rope scaling")
        return cls.gguf_config_class(
            architectures=[cls.architectures[0]],
            vocab_size=value("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
            hidden_size=int(value("embedding_length")),
            intermediate_size=int(value("feed_forward_length", 0) or 1),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=head_dim,
            max_position_embeddings=int(value("context_length")),
            rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
            layer_types=["linear_attention" if r else "full_attention" for r in linear],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": float(value("rope.freq_base", 10000.0)),
                "partial_rotary_factor": int(value("rope.dimension_count")) / head_dim,
            },
            linear_conv_kernel_dim=int(value("ssm.conv_kernel")),
            linear_key_head_dim=int(value("ssm.state_size")),
            linear_num_key_heads=int(value("ssm.group_count")),
            linear_num_value_heads=v_heads,
            linear_value_head_dim=int(value("ssm.inner_size")) // v_heads,
            linear_value_heads_tiled=cls.gguf_tiles_value_heads,
            **cls._gguf_moe_fields(value),
            **gguf_token_fields(metadata, tensor_names),
        )

    @classmethod
    def _gguf_moe_fields(cls, value: Any) -> dict[str, Any]:
        return {}

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | _GGUF_HYBRID_TENSORS

    @classmethod
    def checkpoint_name(cls, gguf_name: str) -> str:
        # (llama.cpp names A without a suffix, and dt_bias as a bias)
        if gguf_name.endswith(".ssm_a"):
            return cls.checkpoint_name(gguf_name + ".weight").removesuffix(".weight")
        name = super().checkpoint_name(gguf_name)
        return name.replace(".linear_attn.dt_bias.bias", ".linear_attn.dt_bias")

    @classmethod
    def checkpoint_tensors(
        cls, gguf_name: str, weight: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        experts = split_stacked_experts(gguf_name, weight)
        yield from experts if experts is not None else super().checkpoint_tensors(gguf_name, weight)

    @classmethod
    def from_gguf_tensor(cls, name: str, weight: torch.Tensor, config: Any) -> torch.Tensor:
        """llama.cpp stores A as -exp(A_log), the convolution without its
        channel dimension and the 1 + w norms as 1 + w: back to the
        checkpoint's tensors."""
        if name.endswith(".linear_attn.A_log"):
            if bool((weight >= 0).any()):
                raise ModelLoadError(f"{name}: llama.cpp's A must be negative")
            return torch.log(-weight.float())
        if name.endswith(".linear_attn.conv1d.weight"):
            return weight.reshape(weight.shape[0], 1, -1)
        if name.endswith(_PLUS_ONE_NORMS) or name == "model.norm.weight":
            return weight - 1
        return weight


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3_5MoeForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "qwen35moe"
    gguf_config_class: ClassVar[Any] = Qwen3_5MoeTextConfig

    @classmethod
    def _gguf_moe_fields(cls, value: Any) -> dict[str, Any]:
        fields = {
            "num_experts": int(value("expert_count")),
            "num_experts_per_tok": int(value("expert_used_count")),
            "moe_intermediate_size": int(value("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(value("expert_shared_feed_forward_length", 0)),
        }
        scale = float(value("expert_weights_scale", 0.0))
        if scale not in (0.0, 1.0):
            raise UnsupportedModelError(f"{cls.gguf_architecture} GGUF with expert_weights_scale")
        return fields

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
        """Block-format experts on the CPU run natively (layers/moe.py), after
        each fused layer where the layers fuse."""
        for layer in self.hybrid_layers():
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.prepare_native()
        return super().prepare_fused_decode()


# llama.cpp's names of the hybrid layers' tensors (beside Llama's).
_GGUF_HYBRID_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

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
