"""ferrox: an LLM inference engine with a Rust scheduling core."""

import importlib
from typing import TYPE_CHECKING, Any

# First: the OpenMP setting must precede any torch import (see common/runtime.py).
from ferrox.common.runtime import __version__

# The public names load on first use: `import ferrox` alone (as the server's
# frontend process does) pulls in neither torch nor the model code.
_EXPORTS = {
    "LLM": "ferrox.llm",
    "AsyncLLM": "ferrox.frontend.async_llm",
    "CompletionOutput": "ferrox.common.outputs",
    "EmbeddingRequestOutput": "ferrox.common.outputs",
    "EngineConfig": "ferrox.common.config",
    "Logprob": "ferrox.common.outputs",
    "LoRARequest": "ferrox.common.lora",
    "RequestMetrics": "ferrox.common.outputs",
    "RequestOutput": "ferrox.common.outputs",
    "PoolingParams": "ferrox.common.pooling_params",
    "SamplingParams": "ferrox.common.sampling_params",
    "ScoringRequestOutput": "ferrox.common.outputs",
    "StructuredOutputsParams": "ferrox.common.structured_outputs",
}

if TYPE_CHECKING:
    from ferrox.common.config import EngineConfig
    from ferrox.common.lora import LoRARequest
    from ferrox.common.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestMetrics,
        RequestOutput,
        ScoringRequestOutput,
    )
    from ferrox.common.pooling_params import PoolingParams
    from ferrox.common.sampling_params import SamplingParams
    from ferrox.common.structured_outputs import StructuredOutputsParams
    from ferrox.frontend.async_llm import AsyncLLM
    from ferrox.llm import LLM


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ferrox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "__version__",
]
