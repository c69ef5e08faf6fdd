"""ferrox: an LLM inference engine with a Rust scheduling core."""

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# GNU OpenMP workers otherwise spin for a long while after each torch op and
# steal the cores from the native kernels that run between ops. It only takes
# effect when ferrox is imported before torch; an explicit setting wins.
OPENMP_SPIN_LIMITED = "torch" not in sys.modules or "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

# The public names load on first use: `import ferrox` alone (as the server's
# frontend process does) pulls in neither torch nor the model code.
_EXPORTS = {
    "LLM": "ferrox.llm",
    "AsyncLLM": "ferrox.async_llm",
    "CompletionOutput": "ferrox.outputs",
    "EngineConfig": "ferrox.config",
    "Logprob": "ferrox.outputs",
    "RequestMetrics": "ferrox.outputs",
    "RequestOutput": "ferrox.outputs",
    "SamplingParams": "ferrox.sampling_params",
    "StructuredOutputsParams": "ferrox.structured_outputs",
}

if TYPE_CHECKING:
    from ferrox.async_llm import AsyncLLM
    from ferrox.config import EngineConfig
    from ferrox.llm import LLM
    from ferrox.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from ferrox.sampling_params import SamplingParams
    from ferrox.structured_outputs import StructuredOutputsParams


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
    "EngineConfig",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
