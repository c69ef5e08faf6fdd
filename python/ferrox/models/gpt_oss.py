"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a mixture-of-experts decoder whose

- attention layers alternate between a sliding window (128 positions) and
  full attention (`layer_types`), with biases on q/k/v/o and an attention
  sink per head: a learned logit that joins each softmax's denominator with
  no value of its own (the backends' `sinks`; the CPU kernel starts each
  query's softmax at the sink);
- rotary embedding is YaRN-scaled (`layers/rotary.py`);
- every layer has experts (layers/moe.py): a router with a bias picks
  `num_experts_per_tok` experts, weighted by the softmax of their logits
  (a renormalised top-k); each expert is a gated MLP with biases and a
  clamped SwiGLU: `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with
  `g = min(gate, l)`.

Checkpoint names (transformers'): the router `mlp.router`, each layer's
experts stacked as `mlp.experts.gate_up_proj` [experts, hidden, 2 x width]
(gate and up columns interleaved) and `mlp.experts.down_proj` [experts,
width, hidden], with `_bias` tensors; they load as one gate/up and one down
linear per expert, gate rows first. Under tensor parallelism each rank holds
its heads' sinks and every expert's slice of columns (interleaved pairs are
adjacent, so a rank's slice is one contiguous range).

OpenAI's checkpoints hold the experts in MXFP4 (`*_blocks`: 32 e2m1
values a block, two a byte, low nibble first; `*_scales`: one e8m0 exponent
a block). On the CPU in float32 they load, exactly, as Q8_0 blocks for the
block kernels: a value e2m1 x 2^(e - 127) is the integer 2 x e2m1 (|q| <= 12)
times the float16 scale 2^(e - 128); scales below 2^-24 (values under 1e-7)
round to zero. Elsewhere, or with quantization="none", they are dequantized.

GGUF (llama.cpp's `gpt-oss`): the sinks as `attn_sinks`, the router as
`ffn_gate_inp`, the experts stacked with gate and up already apart
(`ffn_{gate,up,down}_exps`, with biases), usually in MXFP4, which loads as
Q8_0 blocks too (`loader/gguf_dequant.mxfp4_as_q8_0`); every other layer
local, the first one. The files record neither YaRN's betas and truncation
(read as transformers' gpt-oss defaults: 32, 1, no truncation; llama.cpp
rounds the ramp's ends, a small difference) nor the SwiGLU clamp and alpha
(7 and 1.702, as llama.cpp's graph fixes them).

Refused: MXFP4 under tensor parallelism, other quantization methods, and
attention backends without sinks and windows (the GPU's: not yet run on a
GPU). Chats are in the harmony format: the tokenizer's
template renders them, the server's chat APIs read the channels back
(`server/harmony.py`); `LLM.chat` refuses them.
"""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
from torch import nn
from transformers import GptOssConfig

from ferrox.common.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.attention import AttentionBackend
from ferrox.layers.moe import SparseMoe
from ferrox.layers.quant_linear import QuantLinear
from ferrox.models.base import gguf_token_fields, gguf_value
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.qwen3_moe import split_stacked_experts
from ferrox.parallel import state as distributed

_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class ClampedSwiGluExpert(nn.Module):
    """One expert: down((clamp(up, -l, l) + 1) * g * sigmoid(alpha g)),
    g = min(gate, l); its intermediate columns split over the ranks (the
    block all-reduces the sum of its experts)."""

    activation: ClassVar[str] = "clamped_swiglu"  # (for the native MoE block)

    def __init__(self, config: Any) -> None:
        super().__init__()
        _, inter = distributed.even_shard(int(config.intermediate_size), "intermediate size")
        self.intermediate_size = inter
        self.alpha = float(config.swiglu_alpha)
        self.limit = float(config.swiglu_limit)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=True)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssForCausalLM(LlamaForCausalLM):
    supports_lora = False  # (not yet verified against peft)
    architectures: ClassVar[tuple[str, ...]] = ("GptOssForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "gpt-oss"
    gguf_config_class: ClassVar[Any] = GptOssConfig
    gguf_rotary_interleaved: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        missing = [
            what
            for what, ok in (
                ("attention sinks", backend.supports_sinks),
                ("sliding windows", backend.supports_sliding_window),
            )
            if not ok
        ]
        if missing:
            raise UnsupportedModelError(
                f"gpt-oss needs {' and '.join(missing)}, which the {backend.name!r} attention "
                "backend does not implement yet"
            )
        method = _quant_method(config)
        if method not in (None, "mxfp4"):
            raise UnsupportedModelError(f"gpt-oss with quantization {method!r} is not supported")
        config.attention_bias = True
        super().__init__(config, backend)
        num_heads = self.decoder_layers()[0].self_attn.num_heads
        for layer in self.decoder_layers():
            layer.self_attn.sinks = nn.Parameter(torch.zeros(num_heads))
            layer.mlp = SparseMoe(
                config.hidden_size,
                int(config.num_local_experts),
                int(config.num_experts_per_tok),
                True,  # the softmax of the chosen experts' logits
                lambda: ClampedSwiGluExpert(config),
                router_bias=True,
            )

    @classmethod
    def checkpoint_block_plan(cls, config: Any) -> dict[str, str]:
        """MXFP4 experts load as Q8_0 blocks (where the block kernels run)."""
        if _quant_method(config) != "mxfp4":
            return {}
        return {
            f"layers.{layer}.mlp.experts.{e}.{projection}": "q8_0"
            for layer in range(config.num_hidden_layers)
            for e in range(int(config.num_local_experts))
            for projection in ("gate_up_proj", "down_proj")
        }

    def prepare_fused_decode(self) -> bool:
        """Block-format experts run natively on the CPU (their biases and
        clamped gate included); then decode steps fuse each layer's
        attention half, sinks and all (layers/cpu_decoder.py)."""
        for layer in self.decoder_layers():
            cast(SparseMoe, layer.mlp).prepare_native()
        return super().prepare_fused_decode()

    def shard_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        if distributed.state().size == 1:
            return None
        if name.endswith(("_blocks", "_scales")):
            raise UnsupportedModelError(
                "gpt-oss MXFP4 experts under tensor parallelism are not supported yet"
            )
        if name.endswith(".self_attn.sinks"):
            shard = self.decoder_layers()[0].self_attn.shard
            return 0, shard.q_first, shard.num_heads
        if ".mlp.experts." in name:
            first, count = distributed.even_shard(
                int(self.config.intermediate_size), "intermediate size"
            )
            if name.endswith(".gate_up_proj"):  # [E, hidden, 2 I], pairs adjacent
                return 2, 2 * first, 2 * count
            if name.endswith(".gate_up_proj_bias"):
                return 1, 2 * first, 2 * count
            if name.endswith(".down_proj"):  # [E, I, hidden]
                return 1, first, count
            return None  # the down bias: every rank's, added by rank 0
        return super().shard_of(name, shape)

    @staticmethod
    def module_of(name: str) -> str:
        if ".mlp.experts." in name and name.rsplit(".", 1)[-1] in _STACKED:
            return name.removeprefix("model.").rsplit(".", 1)[0]
        return LlamaForCausalLM.module_of(name.replace(".mlp.router.", ".mlp.gate."))

    # ---- GGUF --------------------------------------------------------------

    @classmethod
    def config_from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> Any:
        """llama.cpp's `gpt-oss` metadata: every other layer local (the first
        one), YaRN from `rope.scaling.*` with transformers' gpt-oss betas and
        truncation, the SwiGLU clamp 7 and alpha 1.702 (the converter records
        neither)."""

        def value(key: str, default: Any = None) -> Any:
            return gguf_value(metadata, "gpt-oss", key, default)

        if value("rope.scaling.type", "yarn") != "yarn":
            raise UnsupportedModelError(
                f"gpt-oss GGUF with rope scaling {value('rope.scaling.type')!r}"
            )
        num_layers = int(value("block_count"))
        heads = int(value("attention.head_count"))
        rope = dict(GptOssConfig().rope_parameters or {})
        rope |= {
            "rope_type": "yarn",
            "rope_theta": float(value("rope.freq_base", rope.get("rope_theta", 150000.0))),
            "factor": float(value("rope.scaling.factor", rope.get("factor", 32.0))),
            "original_max_position_embeddings": int(
                value("rope.scaling.original_context_length", 4096)
            ),
        }
        clamps = set(value("swiglu_clamp_exp", [7.0]) or [7.0])
        if len(clamps) != 1:
            raise UnsupportedModelError(f"gpt-oss GGUF with per-layer SwiGLU clamps {clamps}")
        return GptOssConfig(
            architectures=[cls.architectures[0]],
            swiglu_limit=float(clamps.pop()),
            vocab_size=value("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
            hidden_size=int(value("embedding_length")),
            intermediate_size=int(value("expert_feed_forward_length")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(value("attention.head_count_kv", heads)),
            head_dim=int(value("attention.key_length", 64)),
            num_local_experts=int(value("expert_count")),
            num_experts_per_tok=int(value("expert_used_count")),
            sliding_window=int(value("attention.sliding_window", 128)),
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ],
            max_position_embeddings=int(value("context_length")),
            rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
            rope_parameters=rope,
            **gguf_token_fields(metadata, tensor_names),
        )

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | {
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
        }

    @classmethod
    def checkpoint_tensors(
        cls, gguf_name: str, weight: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stacked experts (gate and up already apart in llama.cpp's
        files) one per expert; the sinks under transformers' name."""
        experts = split_stacked_experts(gguf_name, weight)
        if experts is not None:
            yield from experts
            return
        for name, tensor in super().checkpoint_tensors(gguf_name, weight):
            yield name.removesuffix(".weight") if name.endswith(".sinks.weight") else name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        moe = self.decoder_layers()[0].mlp
        assert isinstance(moe, SparseMoe)
        blocks = isinstance(cast(ClampedSwiGluExpert, moe.experts[0]).gate_up_proj, QuantLinear)
        super().load_weights(_per_expert(_mxfp4_experts(weights, blocks)))


def _quant_method(config: Any) -> str | None:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = (
        quant.get("quant_method")
        if isinstance(quant, dict)
        else getattr(quant, "quant_method", None)
    )
    return str(method)


# e2m1 codes -> values; doubled, they are the integers of a Q8_0 block.
_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _mxfp4_codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] bytes -> [..., G, 32] e2m1 codes (low nibble first)."""
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32).long()


def mxfp4_to_q8_0(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 [..., rows, G, 16] bytes and [..., rows, G] exponents -> Q8_0
    rows [..., rows, G * 34] (a float16 scale, then 32 int8 a block)."""
    exponent = scales.to(torch.int32) - 128
    if int(exponent.max()) > 15:
        raise ModelLoadError("an MXFP4 scale beyond float16's range (2^15)")
    d = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent).to(torch.float16)
    q = (2 * _E2M1)[_mxfp4_codes(blocks)].to(torch.int8)
    out = torch.cat((d.unsqueeze(-1).view(torch.uint8), q.view(torch.uint8)), dim=-1)
    return out.reshape(*blocks.shape[:-2], -1)


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32 [..., rows, G * 32]."""
    values = _E2M1[_mxfp4_codes(blocks)]
    exponent = scales.to(torch.int32).unsqueeze(-1) - 127
    return torch.ldexp(values, exponent).reshape(*blocks.shape[:-2], -1)


def _mxfp4_experts(
    weights: Iterable[tuple[str, torch.Tensor]], keep_blocks: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor's `_blocks` and `_scales` [experts, out, ...]
    as the tensor transformers names without the suffix: float [experts,
    in, out], or (`keep_blocks`) Q8_0 rows [experts, out, bytes] (marked by
    their uint8 dtype)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        stem, _, kind = name.rpartition("_")
        if kind not in ("blocks", "scales") or ".mlp.experts." not in name:
            yield name, tensor
            continue
        parts = pending.setdefault(stem, {})
        parts[kind] = tensor
        if len(parts) < 2:
            continue
        del pending[stem]
        blocks, scales = parts["blocks"], parts["scales"]
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
            raise ModelLoadError(
                f"{stem}: MXFP4 blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}"
            )
        if keep_blocks:
            yield stem, mxfp4_to_q8_0(blocks, scales)
        else:
            yield stem, mxfp4_to_float(blocks, scales).transpose(1, 2)
    if pending:
        raise ModelLoadError(f"MXFP4 tensors without their blocks or scales: {sorted(pending)}")


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' names -> ferrox's: the router as `mlp.gate`, each
    stacked expert tensor as one linear's weight or bias per expert (gate
    rows, then up rows). Q8_0 rows (uint8) are [experts, out, bytes] already."""
    for name, tensor in weights:
        prefix, _, stem = name.rpartition(".")
        if not (prefix.endswith(".mlp.experts") and stem in _STACKED):
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        if tensor.dim() != (3 if stem in ("gate_up_proj", "down_proj") else 2):
            raise ModelLoadError(f"{name} has shape {tuple(tensor.shape)}")
        projection = "down_proj" if stem.startswith("down") else "gate_up_proj"
        suffix = "bias" if stem.endswith("_bias") else "weight"
        for e in range(tensor.shape[0]):
            rows_first = suffix == "bias" or tensor.dtype == torch.uint8
            t = tensor[e] if rows_first else tensor[e].t()  # -> [out, in]
            if projection == "gate_up_proj":
                t = torch.cat((t[0::2], t[1::2]))  # interleaved -> gate rows, up rows
            yield f"{prefix}.{e}.{projection}.{suffix}", t.contiguous()
