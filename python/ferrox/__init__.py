"""ferrox: an LLM inference engine with a Rust scheduling core."""

__version__ = "0.1.0"

from ferrox.config import EngineConfig
from ferrox.llm import LLM
from ferrox.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ferrox.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
