"""Speculative decoding's configuration, spelled as vLLM spells it:
`speculative_config={"method": "ngram", "num_speculative_tokens": 4}` or
`{"method": "draft_model", "model": <path>, "num_speculative_tokens": 4}`.

The scheduler (Rust) proposes n-gram drafts itself and reserves the draft
positions of a draft model, which the runner fills; every draft is verified
exactly by one forward pass of the target model (see
`ferrox._native.Scheduler.update`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferrox.common.errors import InvalidArgumentError

# The most draft tokens per request and step (the scheduler's limit).
MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram", "draft_model")
# Methods of other engines that need model parts ferrox does not build.
_UNBUILT_METHODS = (
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "mtp",
    "deepseek_mtp",
    "suffix",
)
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
    "load_format",
    "adaptive",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model (draft_model)
    load_format: str = "auto"  # of the draft model ("dummy": random weights)
    # Choose each request's draft length from its acceptance and the step's
    # measured cost (False: always num_speculative_tokens where possible).
    adaptive: bool = True
    disable_by_batch_size: int | None = None  # no speculation above this many running

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the command line's form)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise InvalidArgumentError(
                f"speculative_config must be a JSON object, got {type(value).__name__}"
            )
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise InvalidArgumentError(
                f"speculative_config has unsupported key(s) {unknown}; ferrox reads {sorted(_KEYS)}"
            )
        spec = dict(value)
        method = spec.pop("method", None)
        model = spec.get("model")
        if method is None:  # vLLM infers the method from `model`
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
            if model in ("ngram", "[ngram]"):
                spec.pop("model")
        if method in _UNBUILT_METHODS:
            raise InvalidArgumentError(
                f"speculative method {method!r} is not supported; ferrox speculates with "
                f"{list(METHODS)}"
            )
        if method not in METHODS:
            raise InvalidArgumentError(
                f"speculative_config method must be one of {list(METHODS)}, got {method!r}"
            )
        tp = spec.pop("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise InvalidArgumentError(
                f"draft_tensor_parallel_size must be 1 (ferrox runs on one device), got {tp!r}"
            )
        if "num_speculative_tokens" not in spec:
            raise InvalidArgumentError("speculative_config needs num_speculative_tokens")
        try:
            config = cls(method=method, **spec)
        except TypeError as e:
            raise InvalidArgumentError(f"speculative_config: {e}") from e
        config.validate()
        return config

    def validate(self) -> None:
        def integer(name: str, value: object, low: int, high: int | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(
                    f"speculative_config {name} must be an integer >= {low}, got {value!r}"
                )
            if high is not None and value > high:
                raise InvalidArgumentError(
                    f"speculative_config {name} must be at most {high}, got {value}"
                )

        integer("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        integer("prompt_lookup_min", self.prompt_lookup_min, 1)
        integer("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        if self.disable_by_batch_size is not None:
            integer("disable_by_batch_size", self.disable_by_batch_size, 1)
        if not isinstance(self.adaptive, bool):
            raise InvalidArgumentError(
                f"speculative_config adaptive must be true or false, got {self.adaptive!r}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise InvalidArgumentError(
                    "speculative_config method 'draft_model' needs `model`: a smaller model "
                    "with the target's tokenizer"
                )
        elif self.model is not None:
            raise InvalidArgumentError("speculative_config `model` is for method 'draft_model'")

    def scheduler_options(self) -> dict[str, Any]:
        """The native scheduler's speculation arguments."""
        return {
            "speculative_method": "ngram" if self.method == "ngram" else "external",
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
            "spec_adaptive": self.adaptive,
            "spec_disable_by_batch_size": self.disable_by_batch_size,
        }
