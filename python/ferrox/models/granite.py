"""Granite (IBM's `GraniteForCausalLM`, Granite 3.x dense): the Llama decoder
with four scalars of its own (transformers' names):

- `embedding_multiplier`: the token embeddings are scaled by it;
- `attention_multiplier`: the attention scores' scale (instead of
  head_dim ** -0.5);
- `residual_multiplier`: each layer adds its attention and MLP outputs to
  the residual stream scaled by it. Folded at load into the last
  projection of each branch (`o_proj`, `down_proj`, and their biases), so
  the decoder, the CPU's fused decode included, runs as Llama's;
- `logits_scaling`: the logits are divided by it.

GGUF (llama.cpp's `granite`): Llama's tensors, names and Q/K row order, the
four scalars as `granite.embedding_scale`, `granite.attention.scale`,
`granite.residual_scale` and `granite.logit_scale`. Where `attn_output` or
`ffn_down` stay in blocks (Q8_0, Q4_0, Q4_1, Q4_K as Q4_1 blocks or, with
`quantization="gguf"`, Q4_K and Q6_K as stored), the residual scale goes
into each block's float16 factors (scale and offset, Q4_K's d and dmin)
(`quant_linear.scale_blocks`: the codes as stored, each scale within 2^-11
of the exact product, where llama.cpp scales the branch's output instead);
formats that load dequantized take it in float. GraniteMoE and Granite 4's
hybrids are other architectures, not served.
"""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from transformers import GraniteConfig

from ferrox.common.errors import UnsupportedModelError
from ferrox.layers.attention import AttentionBackend
from ferrox.layers.quant_linear import QuantLinear, scale_blocks
from ferrox.models.base import gguf_value
from ferrox.models.llama import LlamaForCausalLM

# The tensors that end a residual branch: the residual multiplier goes there.
_BRANCH_ENDS = (".self_attn.o_proj.", ".mlp.down_proj.")

# GGUF metadata key (after "granite.") -> transformers' config field.
_GGUF_SCALARS = {
    "embedding_scale": "embedding_multiplier",
    "attention.scale": "attention_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}


class GraniteForCausalLM(LlamaForCausalLM):
    supports_lora = False  # (not yet verified against peft)
    architectures: ClassVar[tuple[str, ...]] = ("GraniteForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "granite"
    gguf_config_class: ClassVar[Any] = GraniteConfig

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        super().__init__(config, backend)
        self.embed_scale = float(config.embedding_multiplier)
        self.residual_scale = float(config.residual_multiplier)
        self.logits_scale = float(config.logits_scaling)
        if self.logits_scale == 0.0:
            raise UnsupportedModelError("Granite's logits_scaling must not be 0")

    def attention_scale(self, config: Any) -> float | None:
        return float(config.attention_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._fold_residual_scale(weights))

    def _fold_residual_scale(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """o_proj and down_proj (weights and biases) times the residual
        multiplier: residual + m * (W x + b) = residual + (m W) x + m b."""
        for name, tensor in weights:
            if any(end in name for end in _BRANCH_ENDS) and self.residual_scale != 1.0:
                if tensor.dtype == torch.uint8:  # block-format bytes
                    module = self.get_submodule(name.removeprefix("model.").rpartition(".")[0])
                    assert isinstance(module, QuantLinear)
                    tensor = scale_blocks(tensor, module.fmt, self.residual_scale)
                else:
                    tensor = tensor * torch.tensor(self.residual_scale, dtype=tensor.dtype)
            yield name, tensor

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        scalars = {}
        for key, field in _GGUF_SCALARS.items():
            value = gguf_value(metadata, "granite", key)
            if value is None:
                raise UnsupportedModelError(f"this Granite GGUF file has no granite.{key}")
            scalars[field] = float(value)
        return super()._gguf_config_extra(metadata, tensor_names) | scalars
