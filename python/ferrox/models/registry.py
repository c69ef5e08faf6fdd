"""Model classes by the Hugging Face `architectures` name."""

from typing import Any

from torch import nn

from ferrox.errors import UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.qwen2 import Qwen2ForCausalLM
from ferrox.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(config: Any) -> type[LlamaForCausalLM]:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = _MODELS.get(name)
        if cls is not None:
            return cls  # type: ignore[return-value]
    raise UnsupportedModelError(
        f"unsupported model architecture {names or '(none given)'}; "
        f"ferrox supports {supported_architectures()}"
    )
