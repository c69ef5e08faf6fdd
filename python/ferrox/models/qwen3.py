"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys."""

from typing import Any, ClassVar

from transformers import Qwen3Config

from ferrox.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = (
        "Qwen3ForCausalLM",
        "Qwen3Model",
        "Qwen3ForSequenceClassification",
    )
    qk_norm = True
    gguf_architecture: ClassVar[str | None] = "qwen3"
    gguf_config_class: ClassVar[Any] = Qwen3Config
    gguf_rotary_interleaved: ClassVar[bool] = False

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        return {"attention_bias": "blk.0.attn_q.bias" in tensor_names}

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | {
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        }
