"""EngineCore: the step loop around the Rust scheduler and the model runner.

    plan   = scheduler.schedule()          # Rust, GIL released
    out    = runner.execute(plan, ...)     # tensors, forward, sample
    events = scheduler.update(plan, out.sampled)
    deltas: each progressed sequence's new token ids, logprobs and finish

It never detokenizes: the caller's output processor (`ferrox.frontend`)
turns the deltas into text and stops a sequence whose stop string matched
with `stop_sequence()`. The offline `LLM` drives it in-process; the server
runs the same loop in its engine process.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ferrox import distributed
from ferrox._native import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    BatchPlan,
    Scheduler,
    SchedulerStats,
    StepEvents,
)
from ferrox.config import EngineConfig
from ferrox.engine.grammar import GrammarEngine
from ferrox.engine.prompt_logprobs import prompt_logprob_rows, wire_prompt_logprobs
from ferrox.engine.protocol import PromptLogprobs, SequenceDelta, TokenLogprobs
from ferrox.engine.sequence import EngineRequest, SequenceState, now
from ferrox.engine.speculation import StepCostModel, load_draft_model, sampling_rows
from ferrox.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    EngineDeadError,
    IntegrityError,
    InvalidArgumentError,
    RequestFailedError,
    SchedulerStateError,
)
from ferrox.loader.model_loader import LoadedModel, load_model
from ferrox.outputs import FinishReason
from ferrox.runner.model_runner import ModelRunner, RunnerOutput
from ferrox.runner.sampling_batch import FeatureCounts, SamplingBatch, SamplingBatchBuilder
from ferrox.sampling_params import SamplingParams, check_priority
from ferrox.structured_outputs import check_grammar

logger = logging.getLogger("ferrox")

_FINISH_REASONS: dict[int, FinishReason] = {
    FINISH_STOP: "stop",
    FINISH_LENGTH: "length",
    FINISH_ABORT: "abort",
}
_NO_TOKENS = np.zeros(0, dtype=np.int64)
_SEED_SPACE = 1 << 64


_STAND_IN_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def _stand_in() -> SequenceState:
    """A greedy row in place of a sequence that left during the step."""
    req = EngineRequest("", [], _STAND_IN_PARAMS)
    return SequenceState(-1, -1, req, _STAND_IN_PARAMS, [], [], None)


def is_fatal(exc: BaseException) -> bool:
    """Whether an error in a step may have corrupted state that other
    requests share: a broken scheduler invariant, exhausted host memory, an
    error of the GPU (a failed kernel leaves the device context unusable), or
    a lost tensor-parallel worker."""
    if isinstance(exc, (IntegrityError, MemoryError, EngineDeadError)):
        return True
    name = type(exc).__name__
    if name == "AcceleratorError" or "CUDA error" in str(exc) or "device-side" in str(exc):
        return True
    if distributed.state().size == 1:
        return False
    # Under tensor parallelism a failed collective leaves the ranks out of
    # step (a lost worker is an EngineDeadError already: ModelRunner.execute).
    return isinstance(exc, torch.distributed.DistError) or any(
        s in str(exc) for s in ("gloo", "NCCL", "Connection closed")
    )


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 4096
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < model_max:
        # Sliding-window attention is not implemented: stay inside the window.
        model_max = int(window)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise InvalidArgumentError(
            f"max_model_len={config.max_model_len} exceeds the model's limit of {model_max}"
        )
    return config.max_model_len


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise InvalidArgumentError("a tensor-parallel engine loads its own shards")
            options = {name: getattr(config, name) for name in EngineConfig.field_names()}
            distributed.start(config.tensor_parallel_size, options, config.torch_device)
        try:
            self._init(config, loaded)
        except BaseException:
            distributed.stop()
            raise

    def _init(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        loaded = loaded or load_model(config)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.vocab_size = int(loaded.hf_config.vocab_size)
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = resolve_max_model_len(config, loaded.hf_config)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        spec = config.speculation
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft_model(config, self.vocab_size)
        self.runner = ModelRunner(config, loaded, self.max_model_len, draft)
        self.scheduler = Scheduler(
            block_size=config.block_size,
            num_blocks=self.runner.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.batched_tokens_limit(self.max_model_len),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            **(spec.scheduler_options() if spec is not None else {}),
        )
        self.spec_cost = StepCostModel(self.scheduler) if spec is not None else None
        self._requests: dict[str, EngineRequest] = {}
        self._seqs: dict[int, SequenceState] = {}
        self._next_seq_id = 0
        # Requests whose prompt logprobs are still to come: a step scans its
        # rows for them only while there are some.
        self._num_prompt_logprob_requests = 0
        # Live sequences per sampling feature: unused features cost a step nothing.
        self._features = FeatureCounts()
        self._batch_builder = SamplingBatchBuilder(self.vocab_size, self.runner.device)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        # The scheduler's counters after the last step (they come with its events).
        self.latest_stats: SchedulerStats = self.scheduler.stats()
        self._failures: list[tuple[str, str, str]] = []
        self._stage = "idle"  # of the step in progress: "sampling", then "applying"
        self.last_step_tokens = 0  # tokens the latest step computed
        self._profiler: Any = None
        self._draft_seconds = 0.0  # the draft model's share of the step in progress
        self.grammar = GrammarEngine(self.tokenizer, self.vocab_size, self.eos_token_ids)

    # ---- requests --------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises a typed error for a request the engine cannot serve: the one
        check of a prompt's length and vocabulary and of the output's room."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidArgumentError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if n >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens, but this model's context is {self.max_model_len} "
                "tokens and at least one must be left for the output"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise InvalidArgumentError(
                    f"{name}={value} exceeds the limit of {self.config.max_logprobs}"
                )
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)
        bad_stop = [t for t in params.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        bad_bias = [t for t in params.logit_bias or {} if not 0 <= t < self.vocab_size]
        if bad_stop or bad_bias:
            raise InvalidArgumentError(
                f"token id {(bad_stop + bad_bias)[0]} in stop_token_ids / logit_bias is outside "
                f"the vocabulary [0, {self.vocab_size})"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        final_only: bool = False,
        validated: bool = False,
    ) -> None:
        """`final_only`: the caller wants each sequence's tokens once, when it
        finishes (no stop strings, no streaming): no delta before that.
        `validated`: the caller has run `validate` on this prompt and params."""
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = [int(t) for t in prompt_token_ids]
        if not validated:
            self.validate(prompt_ids, params)
        priority = check_priority(priority)
        # Compiled (or found in the cache) before anything is submitted: a bad
        # grammar fails this request alone. Each completion copies it.
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar.matcher(params.structured_outputs)
        req = EngineRequest(request_id, prompt_ids, params, final_only=final_only)
        if params.prompt_logprobs is not None:
            req.num_prompt_logprobs = 1
            self._num_prompt_logprob_requests += 1
        seqs = [self._new_sequence(req, i) for i in range(params.n)]
        if grammar is not None:
            for seq in seqs:
                seq.grammar = grammar.deep_copy()
        # Siblings start once the first sequence has put the prompt in the
        # prefix cache, so that the prompt is computed once, not n times.
        defer = self.config.enable_prefix_caching and len(prompt_ids) >= self.config.block_size
        first, rest = (seqs[:1], seqs[1:]) if defer else (seqs, [])
        submitted: list[SequenceState] = []
        try:
            for seq in first:
                self._submit(seq, priority)
                submitted.append(seq)
        except BaseException:
            for seq in submitted:  # all or nothing: no sequence stays behind
                self._stop(seq)
            raise
        req.sequences = first
        req.pending_siblings = rest
        self._requests[request_id] = req
        self.num_prompt_tokens += len(prompt_ids)

    def _new_sequence(self, req: EngineRequest, index: int) -> SequenceState:
        params = req.params
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seq = SequenceState(
            seq_id=self._next_seq_id,
            index=index,
            request=req,
            params=params,
            prompt_token_ids=req.prompt_token_ids,
            min_tokens_blocked_ids=sorted(stop_ids),
            seed=None if params.seed is None else (params.seed + index) % _SEED_SPACE,
        )
        self._next_seq_id += 1
        return seq

    def _submit(self, seq: SequenceState, priority: int = 0) -> None:
        params = seq.params
        max_tokens = params.max_tokens or self.max_model_len - len(seq.prompt_token_ids)
        self.scheduler.add_request(
            seq.seq_id,
            np.asarray(seq.prompt_token_ids, dtype=np.int64),
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=params.stop_token_ids or [],
            ignore_eos=params.ignore_eos,
            priority=priority,
            use_prefix_cache=params.prompt_logprobs is None or seq.index > 0,
        )
        self._seqs[seq.seq_id] = seq
        self._features.add(params)

    def _retire(self, seq: SequenceState) -> None:
        """The sequence leaves the scheduler (finished, stopped or aborted)."""
        if self._seqs.pop(seq.seq_id, None) is not None:
            self._features.add(seq.params, -1)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request in any state; its KV blocks return to the pool or
        the prefix cache. False for an unknown id."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        req.pending_siblings.clear()
        for seq in req.sequences:
            self._stop(seq)
        self._forget(req)
        return True

    def stop_sequence(self, request_id: str, index: int, num_output_tokens: int) -> None:
        """Ends one sequence whose stop string the caller matched after
        `num_output_tokens` tokens; tokens sampled past it are not counted.
        Its blocks go back to the pool or the prefix cache."""
        req = self._requests.get(request_id)
        if req is None:
            return
        for seq in req.sequences:
            if seq.index == index and not seq.is_finished:
                self.num_generated_tokens -= max(len(seq.output_token_ids) - num_output_tokens, 0)
                self._stop(seq)
        req.pending_siblings = [s for s in req.pending_siblings if s.index != index]
        if req.is_finished:
            self._forget(req)

    def _stop(self, seq: SequenceState) -> None:
        if not seq.is_finished:
            self.scheduler.abort(seq.seq_id)
            seq.is_finished = True
        self._retire(seq)

    def _forget(self, req: EngineRequest) -> None:
        if self._requests.pop(req.request_id, None) is not None and req.num_prompt_logprobs:
            self._num_prompt_logprob_requests -= 1

    def start_profile(self) -> None:
        """Starts the torch profiler (CPU, and CUDA on a GPU)."""
        if self.config.profiler_dir is None:
            raise InvalidArgumentError("profiling is off: give profiler_dir (--profiler-dir)")
        if self._profiler is not None:
            raise InvalidArgumentError("a profile is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.runner.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()
        atexit.register(self.close)  # a profile left running crashes torch at exit

    def stop_profile(self) -> Path:
        """Stops the profiler; returns the Chrome trace file it wrote (open it
        in Perfetto or chrome://tracing)."""
        if self._profiler is None or self.config.profiler_dir is None:
            raise InvalidArgumentError("no profile is running")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        folder = Path(self.config.profiler_dir)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = folder / f"ferrox-engine-{os.getpid()}-{stamp}-{time.monotonic_ns()}.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
        except OSError as e:
            raise InvalidArgumentError(f"cannot write the profile to {folder}: {e}") from e
        logger.info("profile written to %s", path)
        return path

    def close(self) -> None:
        """Stops a profile still running (torch crashes at process exit
        under a running profiler); its trace is discarded."""
        atexit.unregister(self.close)
        distributed.stop()
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
            logger.warning("a profile was still running at shutdown; its trace is discarded")

    def reset_prefix_cache(self) -> int:
        """Drops every cached prefix no request is using; returns the blocks freed."""
        return self.scheduler.reset_prefix_cache()

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters now (`latest_stats` is free after a step)."""
        return self.scheduler.stats()

    # ---- the step ----------------------------------------------------------

    def step(self) -> tuple[list[SequenceDelta], list[PromptLogprobs]]:
        """Runs one scheduler step; returns each progressed sequence's new
        tokens (and finish), and the prompt logprobs computed in it."""
        plan = self.scheduler.schedule()
        for sid in plan.preempted_ids.tolist():
            if (preempted := self._seqs.get(sid)) is not None:
                preempted.num_preemptions += 1
                preempted.draft_synced = 0  # its blocks may be gone
        self.last_step_tokens = plan.num_tokens
        if plan.num_reqs == 0:
            self.latest_stats = self.scheduler.update(plan, _NO_TOKENS).stats
            return [], []
        try:
            if self.spec_cost is None:
                return self._run_plan(plan)
            self._draft_seconds = 0.0
            start = time.perf_counter()
            result = self._run_plan(plan)
            self.spec_cost.observe(
                plan.num_tokens, plan.num_sampled, time.perf_counter() - start - self._draft_seconds
            )
            return result
        except Exception as exc:
            if is_fatal(exc):
                raise
            error: Exception = exc
        # Before any token of the step was taken, the step can run again
        # without the requests whose own sampling state fails.
        if self._stage == "sampling" and (culprits := self._culprits(plan)):
            self._fail_requests(culprits, error)
            try:
                return self._run_plan(plan)
            except Exception as again:
                if is_fatal(again):
                    raise
                error = again
        self._fail_plan(plan, error)
        return [], []

    def _culprits(self, plan: BatchPlan) -> list[str]:
        """The requests of the step whose sampling state, alone, fails to
        build or to sample (tried on a copy, over zero logits)."""
        culprits: list[str] = []
        device = self.runner.device
        for sid in plan.req_ids[plan.sample_rows].tolist():
            seq = self._seqs.get(sid)
            if seq is None or seq.request.request_id in culprits:
                continue
            probe = copy.copy(seq)
            probe.penalty_state = None  # the real one stays untouched
            try:
                batch = SamplingBatch.build([probe], self.vocab_size, device)
                self.runner.sampler(torch.zeros(1, self.vocab_size, device=device), batch)
            except Exception:
                culprits.append(seq.request.request_id)
        return culprits

    def _fail_requests(self, request_ids: list[str], exc: Exception) -> None:
        logger.error(
            "requests %s failed in a step; the step goes on without them:\n%s",
            request_ids,
            "".join(traceback.format_exception(exc)),
        )
        self._end_failed(
            request_ids, f"the engine failed on this request: {type(exc).__name__}: {exc}"
        )

    def _end_failed(self, request_ids: list[str], message: str) -> None:
        """Aborts the requests (their blocks go back) and records why, for
        `take_failures`."""
        for rid in request_ids:
            self.abort_request(rid)
            self._failures.append((rid, RequestFailedError.__name__, message))

    def take_failures(self) -> list[tuple[str, str, str]]:
        """(request id, error class name, message) of each request a failed
        step ended since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _fail_plan(self, plan: BatchPlan, exc: Exception) -> None:
        """A step failed with an error that cannot have corrupted shared
        state: every request in the step is ended with that error, the plan
        is closed without advancing anything (the KV it wrote lies beyond
        each request's computed tokens, so nothing half-written reaches the
        prefix cache), and the scheduler's invariants are checked; should
        they not hold, the error is fatal after all."""
        logger.error("a step failed; ending the requests in it:\n%s", traceback.format_exc())
        seqs = (self._seqs.get(sid) for sid in plan.req_ids.tolist())
        failed = list(dict.fromkeys(seq.request.request_id for seq in seqs if seq is not None))
        self._end_failed(failed, f"the engine step failed: {type(exc).__name__}: {exc}")
        try:  # every row's request is gone: the update only closes the step
            zeros = np.zeros(len(plan.sample_rows), dtype=np.int64)
            self.latest_stats = self.scheduler.update(plan, zeros).stats
        except SchedulerStateError:
            pass  # the failure came after the scheduler had taken the update
        self.scheduler.check_integrity()

    def _run_plan(self, plan: BatchPlan) -> tuple[list[SequenceDelta], list[PromptLogprobs]]:
        """Runs the plan's step. A row whose request was ended while the plan
        was outstanding is sampled as a greedy stand-in, and the scheduler's
        update skips it."""
        self._stage = "sampling"
        self._note_first_schedules(plan)
        live = [self._seqs.get(rid) for rid in plan.req_ids[plan.sample_rows].tolist()]
        seqs = cast(list[SequenceState], live)
        if None in live:
            seqs = [s or _stand_in() for s in live]
        speculating = plan.num_drafts_total > 0
        drafts = self._propose(plan) if speculating else None
        rows: list[Any] = seqs
        prefixes: list[list[int]] | None = None
        if speculating and self._features.any():
            # A verified position samples as if its drafts were output (all-
            # greedy batches without features read no row: they need no views).
            rows, prefixes = sampling_rows(plan, seqs)
        batch = self._batch_builder.build(rows, self._features)
        if "grammar" in self._features:
            constrained = [
                (i, s.grammar, prefixes[i] if prefixes else [])
                for i, s in enumerate(seqs)
                if s.grammar is not None
            ]
            if constrained:  # computed while the model runs
                batch.grammar = self.grammar.masks(constrained, self.runner.device)
        prompt_rows = (
            prompt_logprob_rows(plan, self._seqs) if self._num_prompt_logprob_requests else []
        )
        out = self.runner.execute(plan, batch, prompt_rows)
        self._stage = "applying"
        prompt = self._prompt_logprobs(plan, out) if out.prompt_logprobs else []
        if not speculating:
            self._append_tokens(seqs, out, batch.max_num_logprobs >= 0)
            events = self.scheduler.update(plan, out.sampled)
            if seqs is not live:  # stand-ins drop out here
                seqs = [s for s in live if s is not None]
            self.num_generated_tokens += len(seqs)
        else:
            events = self.scheduler.update(plan, out.sampled, None, drafts)
            seqs = self._append_verified(plan, events, out, batch.max_num_logprobs >= 0)
        self.latest_stats = events.stats
        self._apply_events(events)
        if batch.grammar is not None:
            start = time.perf_counter()
            if failed := self._advance_grammars(seqs):
                seqs = [s for s in seqs if s.request.request_id not in failed]
            self.grammar.stats.advance_seconds += time.perf_counter() - start
        deltas = [self._delta(seq) for seq in seqs if seq.is_finished or not seq.request.final_only]
        self._start_siblings(seqs)
        for seq in seqs:
            if seq.is_finished and seq.request.is_finished:
                self._forget(seq.request)
        return deltas, prompt

    def _propose(self, plan: BatchPlan) -> np.ndarray | None:
        """A draft model's proposals for the plan's draft positions (written
        into the plan), or None when the scheduler proposed them (n-gram)."""
        draft = self.runner.draft
        if draft is None:
            return None
        start = time.perf_counter()
        rows = np.flatnonzero(plan.num_draft_tokens).tolist()
        seqs = [self._seqs.get(int(plan.req_ids[r])) for r in rows]
        tokens = [s.prompt_token_ids + s.output_token_ids if s else [] for s in seqs]
        synced = [s.draft_synced if s else 0 for s in seqs]
        drafts = draft.propose(plan, tokens, synced)
        for seq, n in zip(seqs, synced, strict=True):
            if seq is not None:
                seq.draft_synced = n
        self._draft_seconds = time.perf_counter() - start
        assert self.spec_cost is not None
        self.spec_cost.observe_drafts(len(drafts), self._draft_seconds)
        return drafts

    def _append_verified(
        self, plan: BatchPlan, events: StepEvents, out: RunnerOutput, logprobs: bool
    ) -> list[SequenceState]:
        """After a step that verified drafts: each sequence gains the tokens
        the scheduler kept, in order (with the logprobs of their positions);
        returns the sequences that progressed."""
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
            if (verified := self._seqs.get(rid)) is not None:
                verified.num_draft_tokens += d
                verified.num_accepted_tokens += a
        taken: dict[int, int] = {}
        progressed: list[SequenceState] = []
        t_now = None
        for rid, tok in zip(events.req_ids.tolist(), events.token_ids.tolist(), strict=True):
            seq = self._seqs.get(rid)
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
                self._add_logprobs(seq, out, start + taken[rid])
            taken[rid] += 1
            self.num_generated_tokens += 1
        return progressed

    def _note_first_schedules(self, plan: BatchPlan) -> None:
        """A prefill row seen for the first time: when it was scheduled, and
        the prompt tokens the prefix cache served (computed before its chunk)."""
        rows = range(plan.num_decodes, plan.num_reqs)
        req_ids, computed = plan.req_ids, plan.num_computed_tokens
        t_now = None
        for row in rows:
            seq = self._seqs.get(int(req_ids[row]))
            if seq is not None and seq.num_cached_tokens is None:
                seq.num_cached_tokens = int(computed[row])
                req = seq.request
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = t_now = t_now or now()

    def _append_tokens(self, seqs: list[SequenceState], out: RunnerOutput, logprobs: bool) -> None:
        t_now = None
        for seq, tok in zip(seqs, out.sampled.tolist(), strict=True):
            output = seq.output_token_ids
            output.append(tok)
            if len(output) == 1:
                seq.first_token_time = t_now = t_now or now()
        if logprobs:
            for i, seq in enumerate(seqs):
                self._add_logprobs(seq, out, i)

    @staticmethod
    def _add_logprobs(seq: SequenceState, out: RunnerOutput, i: int) -> None:
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

    def _advance_grammars(self, seqs: list[SequenceState]) -> set[str]:
        """Each constrained sequence's matcher takes its new token; a token
        the grammar refuses fails the request (returns the failed requests'
        ids). A complete grammar allows only EOS next, which ends the
        sequence in the scheduler; under `ignore_eos` it ends here."""
        failed: set[str] = set()
        for seq in seqs:
            matcher = seq.grammar
            if matcher is None or seq.request.request_id in failed:
                continue
            output = seq.output_token_ids
            accepted = True
            for i in range(seq.num_grammar_tokens, len(output)):
                if i and output[i - 1] in self.eos_token_ids and matcher.is_stopped():
                    # Ended by its EOS under ignore_eos: tokens verified past it go.
                    self.num_generated_tokens -= len(output) - i
                    del output[i:]
                    break
                if not matcher.consume_token(output[i]):
                    accepted = False
                    break
            seq.num_grammar_tokens = len(output)
            if not accepted:
                failed.add(seq.request.request_id)
                logger.error(
                    "request %s left its grammar: %s", seq.request.request_id, matcher.get_error()
                )
            elif not seq.is_finished and matcher.is_stopped() and output[-1] in self.eos_token_ids:
                self._stop(seq)
                seq.finish_reason = "stop"
        if failed:
            self._end_failed(sorted(failed), "the output left its structured-output grammar")
        return failed

    def _apply_events(self, events: StepEvents) -> None:
        reasons = events.finish_reasons
        for row in np.flatnonzero(reasons).tolist():
            seq = self._seqs[int(events.req_ids[row])]
            self._retire(seq)
            seq.is_finished = True
            seq.finish_reason = _FINISH_REASONS[int(reasons[row])]
            last = seq.output_token_ids[-1] if seq.output_token_ids else None
            if seq.finish_reason == "stop" and last in (seq.params.stop_token_ids or ()):
                seq.stop_reason = last

    def _delta(self, seq: SequenceState) -> SequenceDelta:
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
        )

    def _start_siblings(self, seqs: list[SequenceState]) -> None:
        """Submits the other n - 1 sequences once the first has prefilled."""
        for seq in seqs:
            req = seq.request
            if (
                seq.index == 0
                and req.pending_siblings
                and (seq.is_finished or len(seq.output_token_ids) == 1)
            ):
                for sibling in req.pending_siblings:
                    self._submit(sibling)
                req.sequences += req.pending_siblings
                req.pending_siblings = []

    # ---- prompt logprobs ---------------------------------------------------

    def _prompt_logprobs(self, plan: BatchPlan, out: RunnerOutput) -> list[PromptLogprobs]:
        wire = []
        for entry in out.prompt_logprobs:
            seq = self._seqs.get(int(plan.req_ids[entry.row]))
            if seq is None:
                continue  # ended while the step ran
            req = seq.request
            start = int(plan.num_computed_tokens[entry.row])
            if req.num_prompt_logprobs != start + 1:
                continue  # a chunk recomputed after preemption
            req.num_prompt_logprobs += len(entry.token_logprobs)
            wire.append(wire_prompt_logprobs(req.request_id, start + 1, entry))
        return wire
