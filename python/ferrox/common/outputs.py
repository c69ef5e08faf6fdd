"""What a request returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# "stop": EOS, a stop token id or a stop string; "length": max_tokens or the context
# limit; "abort": cancelled by the client or the engine; "error": the engine could
# not go on (no token continues the output under its structured-output grammar).
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort", "error")


@dataclass
class Logprob:
    """Log probability of one token; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> its Logprob (the sampled token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the completion, if any.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={_short(self.token_ids)}, "
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_short(self.logprobs, limit=4)}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # ... and accepted

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens (None without speculation)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def time_in_queue(self) -> float | None:
        return _elapsed(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        return _elapsed(self.arrival_time, self.first_token_time)

    @property
    def e2e_latency(self) -> float | None:
        return _elapsed(self.arrival_time, self.finished_time)


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    # None for the first prompt position, which has no preceding context.
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # An embedding request's pooled state (see `EmbeddingRequestOutput`).
    embedding: list[float] | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={_short(self.prompt_token_ids)}, "
            f"prompt_logprobs={_short(self.prompt_logprobs, limit=4)}, "
            f"outputs={self.outputs!r}, finished={self.finished}, metrics={self.metrics!r})"
        )


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`LLM.embed`), as vLLM's pooling output has it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (logits when the request asked for no activation)


@dataclass
class ClassificationRequestOutput:
    """One prompt's classes (`LLM.classify`), from a sequence-classification head."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
    metrics: RequestMetrics | None = None


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (`LLM.score`): the cosine similarity of the two
    texts' embeddings, or a cross-encoder's probability for the pair."""

    request_id: str
    outputs: ScoringOutput
    finished: bool = True


def _elapsed(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


def _short(values: Sequence[object] | None, limit: int = 16) -> str:
    """The list's repr, or its first ``limit`` items and its length when longer."""
    if values is None or len(values) <= limit:
        return repr(values)
    head = ", ".join(repr(value) for value in values[:limit])
    return f"[{head}, ... ({len(values)} in all)]"
