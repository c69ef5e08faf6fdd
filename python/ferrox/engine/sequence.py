"""Engine-side state of a request and of each of its `n` sequences."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import torch

from ferrox.engine.detokenizer import IncrementalDetokenizer
from ferrox.engine.protocol import TokenLogprobs
from ferrox.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from ferrox.sampling_params import SamplingParams


@dataclass
class SequenceState:
    """One completion (`n` of them per request), one scheduler request."""

    seq_id: int
    index: int
    request: RequestState
    params: SamplingParams
    prompt_token_ids: list[int]
    min_tokens_blocked_ids: list[int]
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_streamed_tokens: int = 0
    # Logprobs of tokens not yet sent, when the caller detokenizes.
    wire_logprobs: TokenLogprobs | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def stops_on(self, token: int) -> bool:
        """Whether `token` ends the sequence as a stop token (EOS or a stop
        token id), by the scheduler's rule: not before `min_tokens`."""
        return token in self.stop_token_ids and len(self.output_token_ids) + 1 >= (
            self.params.min_tokens
        )

    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer else ""

    def completion(self, delta: bool) -> CompletionOutput:
        if delta:
            start = self.num_streamed_tokens
            self.num_streamed_tokens = len(self.output_token_ids)
            text = self.detokenizer.get_delta() if self.detokenizer else ""
            logprobs = self.logprobs[start:] if self.logprobs is not None else None
            token_ids = self.output_token_ids[start:]
        else:
            text, token_ids, logprobs = self.text(), list(self.output_token_ids), self.logprobs
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    metrics: RequestMetrics
    sequences: list[SequenceState] = field(default_factory=list)
    # Siblings wait until the first sequence has prefilled the shared prompt.
    pending_siblings: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def is_finished(self) -> bool:
        return not self.pending_siblings and all(s.is_finished for s in self.sequences)

    def output(self, delta: bool) -> RequestOutput:
        seqs = self.sequences + self.pending_siblings
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[s.completion(delta) for s in sorted(seqs, key=lambda s: s.index)],
            finished=self.is_finished,
            metrics=self.metrics,
        )


def position_logprobs(
    seq: SequenceState,
    token: int,
    token_logprob: float,
    rank: int,
    top_ids: list[int] | None,
    top_logprobs: list[float] | None,
) -> PositionLogprobs:
    """The sampled token's logprob plus the top-k, keyed by token id."""
    decode = seq.detokenizer.decode_token if seq.detokenizer else (lambda _t: None)
    entry: PositionLogprobs = {token: Logprob(token_logprob, rank, cast(str | None, decode(token)))}
    for i, (tid, lp) in enumerate(zip(top_ids or [], top_logprobs or [], strict=True)):
        if tid not in entry:
            entry[tid] = Logprob(lp, i + 1, cast(str | None, decode(tid)))
    return entry


def now() -> float:
    return time.time()
