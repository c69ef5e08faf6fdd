"""The model families ferrox runs: one class each (subclasses for close
relatives), found by the Hugging Face `architectures` name of a config or by
the architecture name of a GGUF file. Adding a family is a file in models/
and a line here."""

from typing import Any

from ferrox.common.errors import UnsupportedModelError
from ferrox.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from ferrox.models.gpt_oss import GptOssForCausalLM
from ferrox.models.granite import GraniteForCausalLM
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.phi3 import Phi3ForCausalLM
from ferrox.models.qwen2 import Qwen2ForCausalLM
from ferrox.models.qwen2_5_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)
from ferrox.models.qwen2_moe import Qwen2MoeForCausalLM
from ferrox.models.qwen3 import Qwen3ForCausalLM
from ferrox.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from ferrox.models.qwen3_moe import Qwen3MoeForCausalLM
from ferrox.models.qwen3_next import Qwen3NextForCausalLM
from ferrox.models.qwen3_vl import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)
from ferrox.models.smollm3 import SmolLM3ForCausalLM

MODEL_CLASSES: tuple[type[LlamaForCausalLM], ...] = (
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen2MoeForCausalLM,
    SmolLM3ForCausalLM,
    Phi3ForCausalLM,
    GraniteForCausalLM,
    Gemma3ForCausalLM,
    GptOssForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Gemma3ForConditionalGeneration,
)

_BY_ARCHITECTURE = {name: cls for cls in MODEL_CLASSES for name in cls.architectures}
_BY_GGUF_ARCHITECTURE = {
    cls.gguf_architecture: cls for cls in MODEL_CLASSES if cls.gguf_architecture is not None
}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def supported_gguf_architectures() -> list[str]:
    return sorted(_BY_GGUF_ARCHITECTURE)


def resolve_model_class(config: Any) -> type[LlamaForCausalLM]:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = _BY_ARCHITECTURE.get(name)
        if cls is not None:
            return cls
    raise UnsupportedModelError(
        f"unsupported model architecture {names or '(none given)'}; "
        f"ferrox supports {supported_architectures()}"
    )


def resolve_gguf_model_class(arch_name: Any) -> type[LlamaForCausalLM]:
    """The family of a GGUF file's `general.architecture`."""
    cls = _BY_GGUF_ARCHITECTURE.get(arch_name) if isinstance(arch_name, str) else None
    if cls is None:
        raise UnsupportedModelError(
            f"GGUF architecture {arch_name!r} is not supported; "
            f"supported: {supported_gguf_architectures()}"
        )
    return cls
