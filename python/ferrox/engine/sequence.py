"""Engine-side state of a request and of each of its `n` sequences: token ids
and what the sampler needs, never text (the caller's output processor
detokenizes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ferrox.common.outputs import FinishReason
from ferrox.common.protocol import SequenceDelta, TokenLogprobs
from ferrox.common.sampling_params import SamplingParams
from ferrox.runner.sampling_batch import PenaltyState

if TYPE_CHECKING:
    from ferrox.runner.model_runner import RunnerOutput


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
    embedding: list[float] | None = None  # an embedding request's pooled state


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
    adapter: int = 0  # the LoRA adapter's internal id (engine/lora.py); 0: none
    # Its images (engine/multimodal.py's RequestImages); None: text only.
    images: Any = None

    @property
    def is_finished(self) -> bool:
        return not self.pending_siblings and all(s.is_finished for s in self.sequences)


def now() -> float:
    return time.time()


def add_logprobs(seq: SequenceState, out: RunnerOutput, i: int) -> None:
    """Sample position i's logprobs, for a sequence that asked for them."""
    k = seq.params.logprobs
    row = None if k is None else out.row_logprobs(i, k)
    if row is None:
        return
    lp, rank, top_ids, top_lps = row
    pending = seq.pending_logprobs
    if pending is None:
        pending = seq.pending_logprobs = TokenLogprobs([], [], [], [])
    pending.logprobs.append(lp)
    pending.ranks.append(rank)
    pending.top_ids.append(top_ids)
    pending.top_logprobs.append(top_lps)


def append_sampled(seqs: list[SequenceState], out: RunnerOutput, logprobs: bool) -> None:
    """Each sequence gains its row's sampled token (and its logprobs)."""
    t_now = None
    for seq, tok in zip(seqs, out.sampled.tolist(), strict=True):
        output = seq.output_token_ids
        output.append(tok)
        if len(output) == 1:
            seq.first_token_time = t_now = t_now or now()
    if logprobs:
        for i, seq in enumerate(seqs):
            add_logprobs(seq, out, i)


def delta_of(seq: SequenceState) -> SequenceDelta:
    """The sequence's tokens (and logprobs) not sent yet, as a delta."""
    start = seq.num_sent_tokens
    seq.num_sent_tokens = len(seq.output_token_ids)
    first = start == 0
    logprobs, seq.pending_logprobs = seq.pending_logprobs, None
    return SequenceDelta(
        request_id=seq.request.request_id,
        index=seq.index,
        token_ids=seq.output_token_ids[start:],
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        first_scheduled_time=seq.request.first_scheduled_time if first else None,
        first_token_time=seq.first_token_time if first and seq.request.final_only else None,
        num_cached_tokens=seq.num_cached_tokens if first else None,
        num_preemptions=seq.num_preemptions if seq.is_finished else 0,
        num_draft_tokens=seq.num_draft_tokens if seq.is_finished else 0,
        num_accepted_tokens=seq.num_accepted_tokens if seq.is_finished else 0,
        embedding=seq.embedding if seq.is_finished else None,
    )
