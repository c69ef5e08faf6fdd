"""EngineCore: the step loop around the Rust scheduler and the model runner.

    plan   = scheduler.schedule()          # Rust, GIL released
    out    = runner.execute(plan, ...)     # tensors, forward, sample
    stops  = detokenize(out)               # stop strings, before the update
    events = scheduler.update(plan, out.sampled, stops)
    outputs for the requests that progressed

The offline `LLM` drives it in-process; the server runs the same loop in its
engine process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from ferrox._native import BatchPlan, Scheduler
from ferrox.config import EngineConfig
from ferrox.engine.detokenizer import IncrementalDetokenizer
from ferrox.engine.output_processor import decode_prompt_logprobs
from ferrox.engine.prompt_logprobs import prompt_logprob_rows, wire_prompt_logprobs
from ferrox.engine.protocol import PromptLogprobs, SequenceDelta, TokenLogprobs
from ferrox.engine.sequence import RequestState, SequenceState, now, position_logprobs
from ferrox.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidArgumentError,
)
from ferrox.loader.model_loader import LoadedModel, load_model
from ferrox.outputs import FinishReason, RequestMetrics, RequestOutput
from ferrox.runner.model_runner import ModelRunner, RunnerOutput
from ferrox.runner.sampling_batch import SamplingBatch
from ferrox.sampling_params import SamplingParams

logger = logging.getLogger("ferrox")

_FINISH_REASONS: dict[int, FinishReason] = {1: "stop", 2: "length", 3: "abort"}
_NO_TOKENS = np.zeros(0, dtype=np.int64)


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
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, *, detokenize: bool = True
    ) -> None:
        """`detokenize=False` (the server's engine process) leaves text, stop
        strings and token strings to the caller, which reads `step_deltas()`."""
        self.config = config
        self.detokenize = detokenize
        loaded = loaded or load_model(config)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.vocab_size = int(loaded.hf_config.vocab_size)
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = resolve_max_model_len(config, loaded.hf_config)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, loaded, self.max_model_len)
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
            num_speculative_tokens=config.num_speculative_tokens,
        )
        self._requests: dict[str, RequestState] = {}
        self._seqs: dict[int, SequenceState] = {}
        self._next_seq_id = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._wire_prompt_logprobs: list[PromptLogprobs] = []

    # ---- requests --------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises a typed error for a request the engine cannot serve."""
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
        bad_stop = [t for t in params.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        bad_bias = [t for t in params.logit_bias or {} if not 0 <= t < self.vocab_size]
        if bad_stop or bad_bias:
            raise InvalidArgumentError(
                f"token id {(bad_stop + bad_bias)[0]} in stop_token_ids / logit_bias is outside "
                f"the vocabulary [0, {self.vocab_size})"
            )
        if params.stop and not self.detokenize:
            raise InvalidArgumentError("stop strings are matched by the caller in this mode")
        if (params.stop or params.logprobs is not None) and self.tokenizer is None:
            raise InvalidArgumentError("stop strings and logprobs need a tokenizer")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        stream: bool = False,
    ) -> None:
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = [int(t) for t in prompt_token_ids]
        self.validate(prompt_ids, params)
        metrics = RequestMetrics(
            arrival_time=arrival_time or now(), num_prompt_tokens=len(prompt_ids)
        )
        req = RequestState(request_id, prompt, prompt_ids, params, stream, metrics)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        seqs = [self._new_sequence(req, i, priority) for i in range(params.n)]
        # Siblings start once the first sequence has put the prompt in the
        # prefix cache, so that the prompt is computed once, not n times.
        defer = self.config.enable_prefix_caching and len(prompt_ids) >= self.config.block_size
        first, rest = (seqs[:1], seqs[1:]) if defer else (seqs, [])
        for seq in first:
            self._submit(seq, priority)
        req.sequences = first
        req.pending_siblings = rest
        self._requests[request_id] = req
        self.num_prompt_tokens += len(prompt_ids)

    def _new_sequence(self, req: RequestState, index: int, priority: int) -> SequenceState:
        params = req.params
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed((params.seed + index) % (1 << 64))
        detok = None
        if self.tokenizer is not None and self.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        seq = SequenceState(
            seq_id=self._next_seq_id,
            index=index,
            request=req,
            params=params,
            prompt_token_ids=req.prompt_token_ids,
            min_tokens_blocked_ids=sorted(stop_ids),
            stop_token_ids=frozenset(stop_ids),
            generator=generator,
            detokenizer=detok,
            logprobs=[] if params.logprobs is not None else None,
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

    def abort_request(self, request_id: str) -> bool:
        """Stops a request in any state; its KV blocks return to the pool or
        the prefix cache. False for an unknown id."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        req.pending_siblings.clear()
        for seq in req.sequences:
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)
                seq.finish_reason = "abort"
            self._seqs.pop(seq.seq_id, None)
        return True

    def finish_sequence(self, request_id: str, index: int) -> None:
        """Ends one sequence of a request as stopped (the caller matched a
        stop string); its blocks go back to the pool or the prefix cache."""
        req = self._requests.get(request_id)
        if req is None:
            return
        for seq in req.sequences:
            if seq.index == index and not seq.is_finished:
                self.scheduler.abort(seq.seq_id)
                seq.finish_reason = "stop"
                self._seqs.pop(seq.seq_id, None)
        req.pending_siblings = [s for s in req.pending_siblings if s.index != index]
        if req.is_finished:
            self._requests.pop(request_id, None)

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

    def stats(self) -> dict[str, int]:
        return cast(dict[str, int], self.scheduler.stats())

    # ---- the step ----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns the finished requests, and a
        delta for each streaming request that produced tokens."""
        return self._collect_outputs(self._run_step())

    def step_deltas(self) -> tuple[list[SequenceDelta], list[PromptLogprobs]]:
        """Runs one scheduler step; returns each progressed sequence's new
        tokens (and finish), for a caller that detokenizes."""
        seqs = self._run_step()
        deltas = [self._delta(seq) for seq in seqs]
        for req in {s.request.request_id: s.request for s in seqs}.values():
            if req.is_finished:
                self._finish_request(req)
        prompt, self._wire_prompt_logprobs = self._wire_prompt_logprobs, []
        return deltas, prompt

    def _run_step(self) -> list[SequenceState]:
        plan = self.scheduler.schedule()
        for sid in plan.preempted_ids.tolist():
            seq = self._seqs.get(sid)
            if seq is not None:
                seq.request.metrics.num_preemptions += 1
        if plan.num_reqs == 0:
            self.scheduler.update(plan, _NO_TOKENS)
            return []
        t_now = now()
        req_ids = plan.req_ids
        for rid in req_ids[plan.num_decodes :].tolist():
            metrics = self._seqs[rid].request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = t_now
        seqs = [self._seqs[rid] for rid in req_ids[plan.sample_rows].tolist()]
        batch = SamplingBatch.build(seqs, self.vocab_size, self.runner.device)
        out = self.runner.execute(plan, batch, prompt_logprob_rows(plan, self._seqs))
        self._record_prompt_logprobs(plan, out)
        stopped = self._append_tokens(seqs, out, t_now)
        events = self.scheduler.update(plan, out.sampled, stopped)
        self.num_generated_tokens += len(seqs)
        self._apply_events(events)
        self._start_siblings(seqs)
        return seqs

    def _delta(self, seq: SequenceState) -> SequenceDelta:
        start = seq.num_streamed_tokens
        seq.num_streamed_tokens = len(seq.output_token_ids)
        first = start == 0
        metrics = seq.request.metrics
        wire, seq.wire_logprobs = seq.wire_logprobs, None
        return SequenceDelta(
            request_id=seq.request.request_id,
            index=seq.index,
            token_ids=seq.output_token_ids[start:],
            logprobs=wire,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason if isinstance(seq.stop_reason, int) else None,
            first_scheduled_time=metrics.first_scheduled_time if first else None,
            num_cached_tokens=metrics.num_cached_tokens if first else None,
        )

    def _append_tokens(
        self, seqs: list[SequenceState], out: RunnerOutput, t_now: float
    ) -> list[int]:
        """Appends each sampled token, detokenizes it and checks stop strings
        (before the scheduler's update, so that a stop string ends the
        sequence in this very step); returns the sequences a stop string ended."""
        stopped = []
        tokens = out.sampled.tolist()
        for i, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
            metrics = seq.request.metrics
            if not seq.output_token_ids:
                info = self.scheduler.request_info(seq.seq_id)
                if info is not None and seq.index == 0:
                    metrics.num_cached_tokens = int(info["num_prefix_hit_tokens"])
                if metrics.first_token_time is None:
                    metrics.first_token_time = t_now
            metrics.last_token_time = t_now
            if seq.stops_on(tok):
                if tok in (seq.params.stop_token_ids or []):
                    seq.stop_reason = tok
            elif seq.detokenizer is not None:
                stop = seq.detokenizer.update([tok])
                if stop is not None:
                    stopped.append(seq.seq_id)
                    seq.stop_reason = stop
            seq.output_token_ids.append(tok)
            if seq.params.logprobs is None:
                continue
            row = out.row_logprobs(i, seq.params.logprobs)
            if row is None:
                continue
            lp, rank, top_ids, top_lps = row
            if not self.detokenize:  # the frontend decodes the tokens
                wire = seq.wire_logprobs
                if wire is None:
                    wire = seq.wire_logprobs = TokenLogprobs([], [], [], [])
                wire.logprobs.append(lp)
                wire.ranks.append(rank)
                wire.top_ids.append(top_ids)
                wire.top_logprobs.append(top_lps)
            elif seq.logprobs is not None:
                seq.cumulative_logprob += lp
                seq.logprobs.append(position_logprobs(seq, tok, lp, rank, top_ids, top_lps))
        return stopped

    def _apply_events(self, events: Any) -> None:
        for rid, reason in zip(
            events.req_ids.tolist(), events.finish_reasons.tolist(), strict=True
        ):
            if reason == 0:
                continue
            seq = self._seqs.pop(rid)
            seq.finish_reason = _FINISH_REASONS[reason]
            if seq.detokenizer is not None and seq.stop_reason is None:
                seq.detokenizer.finish()

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

    def _finish_request(self, req: RequestState) -> None:
        req.metrics.finished_time = now()
        req.metrics.num_generation_tokens = sum(len(s.output_token_ids) for s in req.sequences)
        self._requests.pop(req.request_id, None)

    def _collect_outputs(self, seqs: list[SequenceState]) -> list[RequestOutput]:
        outputs = []
        for req in {s.request.request_id: s.request for s in seqs}.values():
            finished = req.is_finished
            if finished:
                self._finish_request(req)
            if req.stream or finished:
                outputs.append(req.output(delta=req.stream))
        return outputs

    # ---- prompt logprobs ---------------------------------------------------

    def _record_prompt_logprobs(self, plan: BatchPlan, out: RunnerOutput) -> None:
        for entry in out.prompt_logprobs:
            seq = self._seqs[int(plan.req_ids[entry.row])]
            req = seq.request
            start = int(plan.num_computed_tokens[entry.row])
            if req.prompt_logprobs is None or len(req.prompt_logprobs) != start + 1:
                continue  # not asked for, or a chunk recomputed after preemption
            wire = wire_prompt_logprobs(req.request_id, start + 1, entry)
            if not self.detokenize:
                self._wire_prompt_logprobs.append(wire)
                req.prompt_logprobs.extend([None] * len(entry.token_logprobs))
                continue
            decode = seq.detokenizer.decode_token if seq.detokenizer else (lambda _t: None)
            req.prompt_logprobs += decode_prompt_logprobs(
                decode, req.prompt_token_ids, wire.start, wire.logprobs
            )
