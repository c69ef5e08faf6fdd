"""Prompt logprobs: which rows of a step need them, and their wire form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox._native import BatchPlan
from ferrox.common.protocol import PromptLogprobs, TokenLogprobs
from ferrox.engine.sequence import SequenceState


def prompt_logprob_rows(
    plan: BatchPlan, seqs: Mapping[int, SequenceState]
) -> list[tuple[int, int, int]]:
    """(row, top-k, the prompt token after the chunk or -1) for each chunk of
    a prompt whose logprobs were asked for (the request's first sequence)."""
    rows = []
    req_ids, seq_lens, num_sched = plan.req_ids, plan.seq_lens, plan.num_scheduled_tokens
    for row in range(plan.num_reqs):
        seq = seqs.get(int(req_ids[row]))
        if seq is None or seq.index != 0 or seq.request.num_prompt_logprobs is None:
            continue
        prompt, end = seq.prompt_token_ids, int(seq_lens[row])
        if end > len(prompt) or (end == len(prompt) and num_sched[row] == 1):
            continue  # no prompt token left to predict in this chunk
        rows.append(
            (row, seq.params.prompt_logprobs or 0, prompt[end] if end < len(prompt) else -1)
        )
    return rows


def wire_prompt_logprobs(request_id: str, start: int, entry: Any) -> PromptLogprobs:
    """A runner's prompt logprobs for positions [start, start + n) as a message."""
    has_top = entry.top_ids is not None and entry.top_logprobs is not None
    n = len(entry.token_logprobs)
    return PromptLogprobs(
        request_id=request_id,
        start=start,
        logprobs=TokenLogprobs(
            logprobs=entry.token_logprobs.tolist(),
            ranks=entry.token_ranks.tolist(),
            top_ids=entry.top_ids.tolist() if has_top else [[] for _ in range(n)],
            top_logprobs=entry.top_logprobs.tolist() if has_top else [[] for _ in range(n)],
        ),
    )


def prompt_logprobs_of(
    plan: BatchPlan, out: Any, seqs: Mapping[int, SequenceState]
) -> list[PromptLogprobs]:
    """The step's prompt logprobs as messages (`out`: the RunnerOutput),
    skipping sequences that ended and chunks recomputed after preemption."""
    wire = []
    for entry in out.prompt_logprobs:
        seq = seqs.get(int(plan.req_ids[entry.row]))
        if seq is None:
            continue  # ended while the step ran
        req = seq.request
        start = int(plan.num_computed_tokens[entry.row])
        if req.num_prompt_logprobs != start + 1:
            continue  # a chunk recomputed after preemption
        req.num_prompt_logprobs += len(entry.token_logprobs)
        wire.append(wire_prompt_logprobs(req.request_id, start + 1, entry))
    return wire
