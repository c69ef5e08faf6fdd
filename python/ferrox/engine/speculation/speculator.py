"""The speculative-decoding component the step calls.

Proposals come from the Rust scheduler (n-gram: it writes them into the plan)
or from a draft model (`propose`, which writes them into the plan's draft
positions). The step samples a verifying row's positions as `DraftView`s
(`sampling_rows`), the scheduler's update keeps the accepted prefix, and
`append_verified` gives each sequence those tokens. `begin_step` /
`end_step` time the step for the cost model that adaptive speculation
weighs draft tokens by.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from ferrox._native import BatchPlan, Scheduler, StepEvents
from ferrox.engine.sequence import SequenceState, add_logprobs, now
from ferrox.engine.speculation.cost_model import StepCostModel
from ferrox.runner.draft import DraftRunner
from ferrox.runner.model_runner import RunnerOutput


class Speculator:
    def __init__(self, scheduler: Scheduler, draft: DraftRunner | None) -> None:
        self.cost = StepCostModel(scheduler)
        self.draft = draft
        self._draft_seconds = 0.0  # the draft model's share of the step in progress
        self._step_start = 0.0

    def begin_step(self) -> None:
        self._draft_seconds = 0.0
        self._step_start = time.perf_counter()

    def end_step(self, plan: BatchPlan) -> None:
        """A step ran to its end: its time, less the draft model's, feeds the cost fit."""
        seconds = time.perf_counter() - self._step_start - self._draft_seconds
        self.cost.observe(plan.num_tokens, plan.num_sampled, seconds)

    def propose(self, plan: BatchPlan, seqs: Mapping[int, SequenceState]) -> np.ndarray | None:
        """A draft model's proposals for the plan's draft positions (written
        into the plan), or None when the scheduler proposed them (n-gram)."""
        draft = self.draft
        if draft is None or plan.num_drafts_total == 0:
            return None
        start = time.perf_counter()
        rows = np.flatnonzero(plan.num_draft_tokens).tolist()
        found = [seqs.get(int(plan.req_ids[r])) for r in rows]
        tokens = [s.prompt_token_ids + s.output_token_ids if s else [] for s in found]
        synced = [s.draft_synced if s else 0 for s in found]
        drafts = draft.propose(plan, tokens, synced)
        for seq, n in zip(found, synced, strict=True):
            if seq is not None:
                seq.draft_synced = n
        self._draft_seconds = time.perf_counter() - start
        self.cost.observe_drafts(len(drafts), self._draft_seconds)
        return drafts

    @staticmethod
    def append_verified(
        plan: BatchPlan,
        events: StepEvents,
        out: RunnerOutput,
        logprobs: bool,
        seqs: Mapping[int, SequenceState],
    ) -> tuple[list[SequenceState], int]:
        """After a step that verified drafts: each sequence gains the tokens
        the scheduler kept, in order (with the logprobs of their positions).
        Returns the sequences that progressed and the number of tokens gained."""
        # The first sample index of each request's row.
        first_index: dict[int, int] = {}
        for i, rid in enumerate(plan.req_ids[plan.sample_rows].tolist()):
            first_index.setdefault(rid, i)
        for rid, d, a in zip(
            events.verified_ids.tolist(),
            events.num_drafted.tolist(),
            events.num_accepted.tolist(),
            strict=True,
        ):
            if (verified := seqs.get(rid)) is not None:
                verified.num_draft_tokens += d
                verified.num_accepted_tokens += a
        taken: dict[int, int] = {}
        progressed: list[SequenceState] = []
        gained = 0
        t_now = None
        for rid, tok in zip(events.req_ids.tolist(), events.token_ids.tolist(), strict=True):
            seq = seqs.get(rid)
            if seq is None or tok < 0:
                continue
            start = first_index[rid]
            if rid not in taken:
                taken[rid] = 0
                progressed.append(seq)
            seq.output_token_ids.append(tok)
            if len(seq.output_token_ids) == 1:
                seq.first_token_time = t_now = t_now or now()
            if logprobs:
                add_logprobs(seq, out, start + taken[rid])
            taken[rid] += 1
            gained += 1
        return progressed, gained
