"""Fault isolation of a step: one request's error fails that request, not the
engine.

An error that cannot have corrupted shared state (`Executor.is_fatal` says
which can) ends the requests it concerns: before any token of the step was
taken, the step runs again without the requests whose own sampling state
fails on its own; otherwise every request in the step is ended and the plan
closed without advancing anything. Each ended request is recorded for
`take_failures`, so its caller gets the error.
"""

from __future__ import annotations

import copy
import logging
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from ferrox._native import BatchPlan, Scheduler, SchedulerStats
from ferrox.common.errors import RequestFailedError, SchedulerStateError
from ferrox.common.protocol import PromptLogprobs, SequenceDelta
from ferrox.engine.sequence import SequenceState
from ferrox.runner.sampling_batch import SamplingBatch

logger = logging.getLogger("ferrox")

StepResult = tuple[list[SequenceDelta], list[PromptLogprobs]]


class FaultyEngine(Protocol):
    """What fault isolation needs of the engine (EngineCore has it)."""

    executor: Any  # its is_fatal says which errors end the engine
    scheduler: Scheduler
    vocab_size: int
    latest_stats: SchedulerStats

    @property
    def runner(self) -> Any: ...  # its device and sampler probe a request's sampling state

    def sequence(self, seq_id: int) -> SequenceState | None: ...

    def abort_request(self, request_id: str) -> bool: ...


class StepFaults:
    def __init__(self, engine: FaultyEngine) -> None:
        self._engine = engine
        self._failures: list[tuple[str, str, str]] = []
        # Of the step in progress: "sampling" until its tokens are taken, then "applying".
        self.stage = "idle"

    def run(self, plan: BatchPlan, run_plan: Callable[[BatchPlan], StepResult]) -> StepResult:
        """`run_plan(plan)`, with its failures isolated as the module says."""
        is_fatal = self._engine.executor.is_fatal
        try:
            return run_plan(plan)
        except Exception as exc:
            if is_fatal(exc):
                raise
            error: Exception = exc
        if self.stage == "sampling" and (culprits := self._culprits(plan)):
            self.fail_requests(culprits, error)
            try:
                return run_plan(plan)
            except Exception as again:
                if is_fatal(again):
                    raise
                error = again
        self._fail_plan(plan, error)
        return [], []

    def _culprits(self, plan: BatchPlan) -> list[str]:
        """The requests of the step whose sampling state, alone, fails to
        build or to sample (tried on a copy, over zero logits)."""
        engine = self._engine
        culprits: list[str] = []
        device = engine.runner.device
        for sid in plan.req_ids[plan.sample_rows].tolist():
            seq = engine.sequence(sid)
            if seq is None or seq.request.request_id in culprits:
                continue
            probe = copy.copy(seq)
            probe.penalty_state = None  # the real one stays untouched
            try:
                batch = SamplingBatch.build([probe], engine.vocab_size, device)
                engine.runner.sampler(torch.zeros(1, engine.vocab_size, device=device), batch)
            except Exception:
                culprits.append(seq.request.request_id)
        return culprits

    def fail_requests(self, request_ids: list[str], exc: Exception) -> None:
        logger.error(
            "requests %s failed in a step; the step goes on without them:\n%s",
            request_ids,
            "".join(traceback.format_exception(exc)),
        )
        self.end_failed(
            request_ids, f"the engine failed on this request: {type(exc).__name__}: {exc}"
        )

    def end_failed(self, request_ids: list[str], message: str) -> None:
        """Aborts the requests (their blocks go back) and records why."""
        for rid in request_ids:
            self._engine.abort_request(rid)
            self._failures.append((rid, RequestFailedError.__name__, message))

    def record(self, request_id: str, exc: Exception) -> None:
        """A request that failed before it reached the scheduler (its
        grammar did not compile): its caller gets `exc`."""
        self._failures.append((request_id, type(exc).__name__, str(exc)))

    def take_failures(self) -> list[tuple[str, str, str]]:
        """(request id, error class name, message) of each request a failed
        step ended since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _fail_plan(self, plan: BatchPlan, exc: Exception) -> None:
        """Every request in the step is ended with the error, the plan is
        closed without advancing anything (the KV it wrote lies beyond each
        request's computed tokens, so nothing half-written reaches the prefix
        cache), and the scheduler's invariants are checked; should they not
        hold, the error is fatal after all."""
        engine = self._engine
        logger.error("a step failed; ending the requests in it:\n%s", traceback.format_exc())
        seqs = (engine.sequence(sid) for sid in plan.req_ids.tolist())
        failed = list(dict.fromkeys(seq.request.request_id for seq in seqs if seq is not None))
        self.end_failed(failed, f"the engine step failed: {type(exc).__name__}: {exc}")
        try:  # every row's request is gone: the update only closes the step
            zeros = np.zeros(len(plan.sample_rows), dtype=np.int64)
            engine.latest_stats = engine.scheduler.update(plan, zeros).stats
        except SchedulerStateError:
            pass  # the failure came after the scheduler had taken the update
        engine.scheduler.check_integrity()
