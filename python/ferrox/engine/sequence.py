"""Engine-side state of a request and of each of its `n` sequences: token ids
and what the sampler needs, never text (the caller's output processor
detokenizes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ferrox.engine.protocol import TokenLogprobs
from ferrox.outputs import FinishReason
from ferrox.runner.sampling_batch import PenaltyState
from ferrox.sampling_params import SamplingParams


@dataclass
class SequenceState:
    """One completion (`n` of them per request), one scheduler request."""

    seq_id: int
    index: int
    request: EngineRequest
    params: SamplingParams
    prompt_token_ids: list[int]
    min_tokens_blocked_ids: list[int]  # EOS / stop ids masked until min_tokens
    seed: int | None  # the request's seed + index: this sequence's random stream
    output_token_ids: list[int] = field(default_factory=list)
    is_finished: bool = False  # finished, stopped by the caller or aborted
    finish_reason: FinishReason | None = None  # as the scheduler reported it
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served
    first_token_time: float | None = None
    num_sent_tokens: int = 0
    num_preemptions: int = 0
    # Logprobs of tokens not yet sent.
    pending_logprobs: TokenLogprobs | None = None
    penalty_state: PenaltyState | None = None  # the sampler's, when penalised
    grammar: Any = None  # the structured-output matcher (llguidance), when constrained
    num_grammar_tokens: int = 0  # output tokens the matcher has consumed
    # Speculative decoding: tokens whose draft-model KV is valid, and counts.
    draft_synced: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class EngineRequest:
    """A request as the engine holds it (the caller's side is
    `ferrox.frontend.output_processor.RequestState`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = field(default_factory=list)
    # Siblings wait until the first sequence has prefilled the shared prompt.
    pending_siblings: list[SequenceState] = field(default_factory=list)
    # Prompt positions whose logprobs were reported (position 0 has none);
    # None when they were not asked for.
    num_prompt_logprobs: int | None = None
    first_scheduled_time: float | None = None
    final_only: bool = False  # deltas only when a sequence finishes

    @property
    def is_finished(self) -> bool:
        return not self.pending_siblings and all(s.is_finished for s in self.sequences)


def now() -> float:
    return time.time()
