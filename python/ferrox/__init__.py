"""ferrox: an LLM inference engine with a Rust scheduling core."""

import os
import sys

__version__ = "0.1.0"

# GNU OpenMP workers otherwise spin for a long while after each torch op and
# steal the cores from the native kernels that run between ops. It only takes
# effect when ferrox is imported before torch; an explicit setting wins.
OPENMP_SPIN_LIMITED = "torch" not in sys.modules or "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from ferrox.async_llm import AsyncLLM  # noqa: E402
from ferrox.config import EngineConfig  # noqa: E402
from ferrox.llm import LLM  # noqa: E402
from ferrox.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from ferrox.sampling_params import SamplingParams  # noqa: E402
from ferrox.structured_outputs import StructuredOutputsParams  # noqa: E402

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
