"""Per-request sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.pooling_params import PoolingParams
from ferrox.common.structured_outputs import StructuredOutputsParams

# Temperatures below this sample greedily (argmax); dividing logits by them would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5
LOGIT_BIAS_LIMIT = 100.0
# The range torch.Generator.manual_seed accepts.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# Counts and token ids travel to the engine as 32-bit integers.
MAX_INT32 = 2**31 - 1
# A request's scheduling priority (lower runs first) is a 32-bit integer too.
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = MAX_INT32


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample the completion(s) of one request.

    After construction ``stop`` and ``stop_token_ids`` are always lists, numbers are
    Python ``float`` / ``int``, and ``logit_bias`` values are clamped to [-100, 100].
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context limit
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs returned next to each sampled token
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output must match a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # An embedding request (`LLM.embed`, /v1/embeddings): the prompt's pooled
    # hidden state is the output; one sequence, one token, nothing sampled
    # that anyone reads.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, minimum=1, maximum=MAX_INT32)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, minimum=1, maximum=MAX_INT32)
        self.min_tokens = _int("min_tokens", self.min_tokens, minimum=0, maximum=MAX_INT32)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgumentError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        self.temperature = _float("temperature", self.temperature, low=0.0)
        self.top_p = _float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.top_k = _int(
            "top_k", self.top_k, minimum=-1, maximum=MAX_INT32, hint="-1 or 0 disables it"
        )
        self.min_p = _float("min_p", self.min_p, low=0.0, high=1.0)
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, low=0.0, low_open=True
        )
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, minimum=MIN_SEED, maximum=MAX_SEED)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, minimum=0, maximum=MAX_INT32)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int(
                "prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=MAX_INT32
            )
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidArgumentError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}"
            )
        if self.structured_outputs is not None and self.min_tokens:
            raise InvalidArgumentError(
                "min_tokens cannot be combined with structured_outputs: the grammar decides "
                "where the output ends"
            )
        if isinstance(self.pooling, dict):
            self.pooling = PoolingParams(**self.pooling)
        if self.pooling is not None:
            self._check_pooling()
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"{name} must be a bool, got {type(getattr(self, name)).__name__}"
                )

    def _check_pooling(self) -> None:
        if not isinstance(self.pooling, PoolingParams):
            raise InvalidArgumentError(
                f"pooling must be a PoolingParams, got {type(self.pooling).__name__}"
            )
        if self.n != 1 or self.max_tokens != 1 or self.min_tokens:
            raise InvalidArgumentError("an embedding request has n = 1 and max_tokens = 1")
        if (
            self.logprobs is not None
            or self.prompt_logprobs is not None
            or self.structured_outputs is not None
        ):
            raise InvalidArgumentError(
                "an embedding request has no logprobs, prompt logprobs or structured outputs"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


def check_priority(priority: Any) -> int:
    """A request's scheduling priority, checked against the engine's range."""
    return _int("priority", priority, minimum=MIN_PRIORITY, maximum=MAX_PRIORITY)


def _int(
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else str(minimum)
        high = "inf" if maximum is None else str(maximum)
        note = f" ({hint})" if hint else ""
        raise InvalidArgumentError(f"{name} must be in [{low}, {high}]{note}, got {value}")
    return int(value)


def _float(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if math.isnan(number) or math.isinf(number) or too_low or number > high:
        raise InvalidArgumentError(
            f"{name} must be a finite number{_interval(low, high, low_open)}, got {value!r}"
        )
    return number


def _interval(low: float, high: float, low_open: bool) -> str:
    if low == -math.inf and high == math.inf:
        return ""
    left = "(" if low_open or low == -math.inf else "["
    right = ")" if high == math.inf else "]"
    return f" in {left}{low:g}, {high:g}{right}"


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidArgumentError(
            f"stop must be a str, a list of str or None, got {type(stop).__name__}"
        )
    for item in stop:
        if not isinstance(item, str):
            raise InvalidArgumentError(f"stop must contain only str, got {type(item).__name__}")
        if not item:
            raise InvalidArgumentError("stop strings must be non-empty, got ''")
    return list(stop)


def _token_ids(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise InvalidArgumentError(f"{name} must be a list of int, got {type(ids).__name__}")
    return [_int(f"{name} entries", token_id, minimum=0, maximum=MAX_INT32) for token_id in ids]


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise InvalidArgumentError(
            f"logit_bias must be a dict[int, float], got {type(bias).__name__}"
        )
    clamped: dict[int, float] = {}
    for token_id, value in bias.items():
        token_id = _int("logit_bias keys (token ids)", token_id, minimum=0, maximum=MAX_INT32)
        number = _float("logit_bias values", value)
        clamped[token_id] = min(max(number, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return clamped
