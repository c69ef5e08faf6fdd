"""Qwen2: the Llama decoder with biases on the Q, K and V projections."""

from typing import Any, ClassVar

from transformers import Qwen2Config

from ferrox.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = (
        "Qwen2ForCausalLM",
        "Qwen2Model",
        "Qwen2ForSequenceClassification",
    )
    qkv_bias = True
    gguf_architecture: ClassVar[str | None] = "qwen2"
    gguf_config_class: ClassVar[Any] = Qwen2Config
    gguf_rotary_interleaved: ClassVar[bool] = False

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        return {}  # Qwen2Config has the q/k/v biases built in
