"""EngineCore: the step loop around the Rust scheduler and the executor.

    plan   = scheduler.schedule()                      # Rust, GIL released
    inputs = sampling rows, grammar masks, drafts      # the step's components
    out    = executor.execute(plan, inputs)            # forward and sample, every rank
    events = scheduler.update(plan, out.sampled)       # Rust: accept, stop, free/cache
    deltas : each progressed sequence's new token ids, logprobs and finish

Speculative decoding (`engine/speculation`) and structured outputs
(`engine/structured_output`) are components the step calls; fault isolation
(`engine/faults.py`) wraps the step. The engine never detokenizes: the
caller's output processor (`ferrox.frontend`) turns the deltas into text and
stops a sequence whose stop string matched with `stop_sequence()`. The
offline `LLM` drives it in-process; the server runs the same loop in its
engine process (`engine/core_process.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from ferrox._native import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    BatchPlan,
    Scheduler,
    SchedulerStats,
    StepEvents,
)
from ferrox.common.config import EngineConfig
from ferrox.common.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidArgumentError,
    ModelLoadError,
)
from ferrox.common.lora import LoRARequest
from ferrox.common.multimodal import PLACEHOLDER_BASE, ImageInput
from ferrox.common.outputs import FinishReason
from ferrox.common.protocol import SequenceDelta
from ferrox.common.sampling_params import SamplingParams, check_priority
from ferrox.common.speculative_config import SpeculativeConfig
from ferrox.common.structured_outputs import check_grammar
from ferrox.engine.faults import StepFaults, StepResult
from ferrox.engine.lora import AdapterRegistry
from ferrox.engine.multimodal import (
    RequestImages,
    prepare_images,
    scheduler_prompt,
    step_images,
)
from ferrox.engine.profiler import EngineProfiler
from ferrox.engine.prompt_logprobs import prompt_logprob_rows, prompt_logprobs_of
from ferrox.engine.sequence import EngineRequest, SequenceState, append_sampled, delta_of, now
from ferrox.engine.speculation import Speculator, load_draft_model, sampling_rows
from ferrox.engine.structured_output import GrammarEngine, PendingGrammar
from ferrox.executor.executor import Executor
from ferrox.loader.model_loader import LoadedModel
from ferrox.runner.model_runner import ModelRunner, RunnerOutput
from ferrox.runner.sampling_batch import FeatureCounts, SamplingBatch, SamplingBatchBuilder

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


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        spec = config.speculation

        def load_draft(target: LoadedModel) -> LoadedModel | None:
            if spec is None or spec.method != "draft_model":
                return None
            return load_draft_model(config, int(target.hf_config.vocab_size))

        self.executor = Executor(config, loaded, load_draft)
        try:
            self._init(config, spec)
        except BaseException:
            self.executor.close()
            raise

    def _init(self, config: EngineConfig, spec: SpeculativeConfig | None) -> None:
        loaded = self.loaded = self.executor.loaded
        if config.runner == "generate" and not loaded.model.generates:
            raise ModelLoadError(
                "runner='generate' needs a model with an LM head; this checkpoint (an "
                "embedding model's base model or a classifier) serves pooling requests only"
            )
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.vocab_size = int(loaded.hf_config.vocab_size)
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = self.executor.max_model_len
        # A model with images: the scheduler's token ids include the images'
        # placeholder ids (common/multimodal.py), above every vocabulary;
        # `validate` checks the prompt's real ids against the vocabulary.
        serves_images = bool(getattr(loaded.model, "supports_images", False))
        if serves_images and spec is not None:
            raise InvalidArgumentError(
                "speculative decoding is not supported with a vision-language model"
            )
        scheduler_vocab = PLACEHOLDER_BASE * 2 - 1 if serves_images else self.vocab_size
        self.scheduler = Scheduler(
            block_size=config.block_size,
            num_blocks=self.runner.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.batched_tokens_limit(self.max_model_len),
            max_model_len=self.max_model_len,
            vocab_size=scheduler_vocab,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            sliding_window=self.runner.sliding_window,
            num_window_blocks=self.runner.num_window_blocks,
            max_adapters=config.max_loras if config.enable_lora else 0,
            num_state_slots=self.runner.num_state_slots,
            num_state_snapshots=self.runner.num_state_snapshots,
            # A step encodes about as many image rows as it computes tokens.
            max_encoder_tokens_per_step=(
                config.batched_tokens_limit(self.max_model_len) if serves_images else 0
            ),
            **(spec.scheduler_options() if spec is not None else {}),
        )
        self.speculator = (
            Speculator(self.scheduler, self.runner.draft) if spec is not None else None
        )
        self.grammar = GrammarEngine(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.adapters = (
            AdapterRegistry(self.executor, config.max_cpu_loras or config.max_loras)
            if config.enable_lora
            else None
        )
        self.faults = StepFaults(self)
        self.profiler = EngineProfiler(config.profiler_dir, self.runner.device)
        self._requests: dict[str, EngineRequest] = {}
        self._compiling: dict[str, _Compiling] = {}  # requests waiting for their grammar
        self._seqs: dict[int, SequenceState] = {}
        # Sequences not yet in a plan (see _note_first_schedules).
        self._unscheduled: set[int] = set()
        self._next_seq_id = 0
        # Requests whose prompt logprobs are still to come: a step scans its
        # rows for them only while there are some.
        self._num_prompt_logprob_requests = 0
        # Requests with images: a step builds their image inputs only while there are some.
        self._num_image_requests = 0
        # Live sequences per sampling feature: unused features cost a step nothing.
        self._features = FeatureCounts()
        self._batch_builder = SamplingBatchBuilder(self.vocab_size, self.runner.device)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        # The scheduler's counters after the last step (they come with its events).
        self.latest_stats: SchedulerStats = self.scheduler.stats()
        self.last_step_tokens = 0  # tokens the latest step computed

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner (its model, KV cache and sampler)."""
        return self.executor.runner

    def sequence(self, seq_id: int) -> SequenceState | None:
        return self._seqs.get(seq_id)

    # ---- requests --------------------------------------------------------

    def validate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, grammar: bool = True
    ) -> None:
        """Raises a typed error for a request the engine cannot serve: the one
        check of a prompt's length and vocabulary and of the output's room.
        `grammar`: whether the output grammar is checked here too (else where
        it compiles, off the step)."""
        n = len(prompt_token_ids)
        if params.pooling is not None:
            self._check_pooling_task(params.pooling.task)
            if params.pooling.dimensions is not None:
                self._check_dimensions(params.pooling.dimensions, params.pooling.task)
        if params.pooling is None and not self.runner.model.generates:
            raise InvalidArgumentError(
                "this model's checkpoint has no LM head (an embedding model's base model or a "
                "classifier): it serves pooling requests (LLM.embed / classify / score, "
                "/v1/embeddings, /v1/classify, /v1/score, /v1/rerank), not generation"
            )
        if params.pooling is None and self.config.runner == "pooling":
            raise InvalidArgumentError(
                "this engine runs its model for pooling (runner='pooling'): it serves "
                "embeddings, classification and scores, not generation"
            )
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
        if grammar and params.structured_outputs is not None:
            check_grammar(params.structured_outputs)
        if (
            params.pooling is not None
            and self.executor.worker_processes()
            and self.runner.graphs is not None
        ):
            raise InvalidArgumentError(
                "embeddings are not supported with tensor parallelism and CUDA graphs; "
                "start the engine with enforce_eager=True"
            )
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
        lora_request: LoRARequest | None = None,
        images: Sequence[ImageInput] | None = None,
    ) -> None:
        """`final_only`: the caller wants each sequence's tokens once, when it
        finishes (no stop strings, no streaming): no delta before that.
        `validated`: the caller has run `validate` on this prompt and params.
        `lora_request`: the LoRA adapter the request runs under (None: the
        base model). `images`: the prompt's processed images, whose
        placeholder tokens it holds (common/multimodal.py)."""
        if request_id in self._requests or request_id in self._compiling:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = [int(t) for t in prompt_token_ids]
        if not validated:  # (a grammar is checked where it compiles, off the step)
            self.validate(prompt_ids, params, grammar=False)
        held = None
        if images:
            limits = self.config.limit_mm_per_prompt
            limit = limits.get("image") if isinstance(limits, dict) else None
            held = prepare_images(self.runner.model, prompt_ids, images, params, limit)
        priority = check_priority(priority)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidArgumentError(
                f"priority {priority} needs scheduling_policy 'priority'; this engine "
                f"schedules by {self.config.scheduling_policy!r}"
            )
        adapter = self._acquire_adapter(lora_request)
        try:
            # A grammar the cache lacks compiles off the step; the request
            # waits for it outside the scheduler (`_admit_compiled`).
            grammar = None
            if params.structured_outputs is not None:
                grammar = self.grammar.cached(params.structured_outputs)
                if grammar is None:
                    pending = self.grammar.compile_later(params.structured_outputs)
                    self._compiling[request_id] = _Compiling(
                        prompt_ids, params, priority, final_only, pending, adapter, held
                    )
                    return
            self._admit(
                request_id, prompt_ids, params, priority, final_only, grammar, adapter, held
            )
        except BaseException:
            self._release_adapter(adapter)
            raise

    def _acquire_adapter(self, lora_request: LoRARequest | None) -> int:
        """The internal id of the request's adapter (0: none), loaded."""
        if lora_request is None:
            return 0
        if self.adapters is None:
            raise InvalidArgumentError(
                f"the request names LoRA adapter {lora_request.lora_name!r}, but this engine "
                "serves none: start it with enable_lora=True"
            )
        return self.adapters.acquire(lora_request)

    def _release_adapter(self, adapter: int) -> None:
        if adapter and self.adapters is not None:
            self.adapters.release(adapter)

    def _admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        final_only: bool,
        grammar: Any,
        adapter: int = 0,
        images: RequestImages | None = None,
    ) -> None:
        """The request's sequences reach the scheduler (each completion
        copies the compiled grammar). On success the request holds its
        adapter's use (given back by `_forget`)."""
        req = EngineRequest(
            request_id, prompt_ids, params, final_only=final_only, adapter=adapter, images=images
        )
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
        if images is not None:
            self._num_image_requests += 1
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
        images = seq.request.images
        self.scheduler.add_request(
            seq.seq_id,
            scheduler_prompt(seq.prompt_token_ids, images),
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=params.stop_token_ids or [],
            ignore_eos=params.ignore_eos,
            priority=priority,
            use_prefix_cache=params.prompt_logprobs is None or seq.index > 0,
            adapter=seq.request.adapter,
            atomic_spans=None if images is None else images.atomic_spans(),
            encoder_spans=None if images is None else images.encoder_spans(),
        )
        self._seqs[seq.seq_id] = seq
        self._unscheduled.add(seq.seq_id)
        self._features.add(params)

    def _retire(self, seq: SequenceState) -> None:
        """The sequence leaves the scheduler (finished, stopped or aborted)."""
        self._unscheduled.discard(seq.seq_id)
        if self._seqs.pop(seq.seq_id, None) is not None:
            self._features.add(seq.params, -1)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request in any state; its KV blocks return to the pool or
        the prefix cache. False for an unknown id."""
        if (waiting := self._compiling.pop(request_id, None)) is not None:
            self._release_adapter(waiting.adapter)
            return True  # its grammar's compile goes on; the cache keeps it
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
        if self._requests.pop(req.request_id, None) is None:
            return
        if req.num_prompt_logprobs:
            self._num_prompt_logprob_requests -= 1
        if req.images is not None:
            self._num_image_requests -= 1
        self._release_adapter(req.adapter)

    def start_profile(self) -> None:
        """Starts the torch profiler (CPU, and CUDA on a GPU)."""
        self.profiler.start()

    def stop_profile(self) -> Path:
        """Stops the profiler; returns the Chrome trace file it wrote."""
        return self.profiler.stop()

    def close(self) -> None:
        """Stops the tensor-parallel workers and a profile still running."""
        self.executor.close()
        self.profiler.close()

    def take_failures(self) -> list[tuple[str, str, str]]:
        """(request id, error class name, message) of each request a failed
        step ended since the last call."""
        return self.faults.take_failures()

    def reset_prefix_cache(self) -> int:
        """Drops every cached prefix no request is using; returns the blocks freed."""
        return self.scheduler.reset_prefix_cache()

    def request_ids(self) -> list[str]:
        return [*self._requests, *self._compiling]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._compiling)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests) + len(self._compiling)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters now (`latest_stats` is free after a step)."""
        return self.scheduler.stats()

    # ---- the step ----------------------------------------------------------

    def step(self) -> StepResult:
        """Runs one scheduler step; returns each progressed sequence's new
        tokens (and finish), and the prompt logprobs computed in it."""
        if self._compiling:
            self._admit_compiled()
        plan = self.scheduler.schedule()
        self._note_preemptions(plan)
        self.last_step_tokens = plan.num_tokens
        if plan.num_reqs == 0:
            self.latest_stats = self.scheduler.update(plan, _NO_TOKENS).stats
            if self._compiling:  # nothing to run but grammars to wait for
                self.grammar.wait([c.grammar for c in self._compiling.values()], 0.01)
            return [], []
        return self.faults.run(plan, self._run_plan)

    def _run_plan(self, plan: BatchPlan) -> StepResult:
        """schedule (done) -> build inputs -> execute -> update -> outputs. A
        row whose request was ended while the plan was outstanding is sampled
        as a greedy stand-in, and the scheduler's update skips it."""
        self.faults.stage = "sampling"
        if self.speculator is not None:
            self.speculator.begin_step()
        live, seqs, batch, drafts = self._build_inputs(plan)
        prompt_rows = (
            prompt_logprob_rows(plan, self._seqs) if self._num_prompt_logprob_requests else []
        )
        pool_rows = self._pool_rows(live) if "pooling" in self._features else None
        images = step_images(plan, self._seqs) if self._num_image_requests else None
        out = self.executor.execute(plan, batch, prompt_rows, pool_rows, images)
        self.faults.stage = "applying"
        if pool_rows:
            _keep_pooled(live, pool_rows, out)
        # (before the update, which retires the sequences that finished)
        prompt = prompt_logprobs_of(plan, out, self._seqs) if out.prompt_logprobs else []
        progressed = self._update(plan, live, seqs, batch, out, drafts)
        result = self._outputs(progressed), prompt
        if self.speculator is not None:
            self.speculator.end_step(plan)
        return result

    def _check_dimensions(self, dimensions: int, task: str) -> None:
        """Matryoshka truncation: only for a model trained for it (its config
        says `is_matryoshka`, or lists `matryoshka_dimensions`)."""
        config = self.hf_config
        allowed = getattr(config, "matryoshka_dimensions", None)
        if task != "embed":
            raise InvalidArgumentError("dimensions applies to embeddings only")
        if not (getattr(config, "is_matryoshka", False) or allowed):
            raise InvalidArgumentError(
                "dimensions needs a Matryoshka-trained model: this model's config says neither "
                "is_matryoshka nor matryoshka_dimensions (hf_overrides can set them for a model "
                "trained so)"
            )
        hidden = int(config.hidden_size)
        if dimensions > hidden or (allowed and dimensions not in allowed):
            valid = f"one of {list(allowed)}" if allowed else f"at most {hidden}"
            raise InvalidArgumentError(f"dimensions must be {valid}, got {dimensions}")

    def _check_pooling_task(self, task: str) -> None:
        model = self.runner.model
        if self.config.runner == "generate":
            raise InvalidArgumentError(
                "this engine runs its model for generation (runner='generate'): it serves no "
                "pooling requests"
            )
        if task == "embed" and model.generates and self.config.convert == "none":
            raise InvalidArgumentError(
                "this causal LM is not converted into an embedding model (convert='none'); "
                "start the engine with convert='embed' (or 'auto')"
            )
        if task == "classify" and model.labels is None:
            raise InvalidArgumentError(
                "this model has no sequence-classification head: it embeds (LLM.embed, "
                "/v1/embeddings) and scores by the cosine of embeddings, but does not classify"
            )
        if task == "embed" and model.labels is not None:
            raise InvalidArgumentError(
                "this model is a sequence classifier (a cross-encoder): use LLM.classify or "
                "LLM.score (/v1/classify, /v1/score, /v1/rerank), not embeddings"
            )

    @staticmethod
    def _pool_rows(live: list[SequenceState | None]) -> list[int]:
        """The sample rows of pooling requests: each one's first, the end of
        its prompt (a row that verifies drafts, should one have them, comes
        after it)."""
        rows, seen = [], set()
        for i, seq in enumerate(live):
            if seq is not None and seq.params.pooling is not None and seq.seq_id not in seen:
                seen.add(seq.seq_id)
                rows.append(i)
        return rows

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled reach the scheduler; one whose
        grammar failed to compile, or is still compiling at its deadline,
        fails (InvalidArgumentError: a 400)."""
        for rid, waiting in list(self._compiling.items()):
            try:
                grammar = self.grammar.ready(waiting.grammar)
                if grammar is None:
                    continue
                del self._compiling[rid]
                self._admit(
                    rid,
                    waiting.prompt_ids,
                    waiting.params,
                    waiting.priority,
                    waiting.final_only,
                    grammar,
                    waiting.adapter,
                    waiting.images,
                )
            except Exception as exc:
                if self.executor.is_fatal(exc):
                    raise
                self._compiling.pop(rid, None)
                self._release_adapter(waiting.adapter)
                self.faults.record(rid, exc)

    def _note_preemptions(self, plan: BatchPlan) -> None:
        for sid in plan.preempted_ids.tolist():
            if (preempted := self._seqs.get(sid)) is not None:
                preempted.num_preemptions += 1
                preempted.draft_synced = 0  # its blocks may be gone

    def _build_inputs(
        self, plan: BatchPlan
    ) -> tuple[list[SequenceState | None], list[SequenceState], SamplingBatch, np.ndarray | None]:
        """The step's sequences (None where one left), the rows to sample
        (stand-ins for those), the sampling batch with its grammar masks
        (computed while the model runs), and a draft model's proposals."""
        self._note_first_schedules(plan)
        live = [self._seqs.get(rid) for rid in plan.req_ids[plan.sample_rows].tolist()]
        seqs = cast(list[SequenceState], live)
        if None in live:
            seqs = [s or _stand_in() for s in live]
        speculating = plan.num_drafts_total > 0
        drafts = None
        rows: list[Any] = seqs
        prefixes: list[list[int]] | None = None
        if speculating and self.speculator is not None:
            drafts = self.speculator.propose(plan, self._seqs)
            if self._features.any():
                # A verified position samples as if its drafts were output (all-
                # greedy batches without features read no row: they need no views).
                rows, prefixes = sampling_rows(plan, seqs)
        batch = self._batch_builder.build(rows, self._features)
        if "grammar" in self._features:
            batch.grammar = self.grammar.constrain(seqs, prefixes, self.runner.device)
        return live, seqs, batch, drafts

    def _update(
        self,
        plan: BatchPlan,
        live: list[SequenceState | None],
        seqs: list[SequenceState],
        batch: SamplingBatch,
        out: RunnerOutput,
        drafts: np.ndarray | None,
    ) -> list[SequenceState]:
        """The sampled tokens reach the scheduler and the sequences; the
        grammars advance. Returns the sequences that progressed."""
        logprobs = batch.max_num_logprobs >= 0
        if plan.num_drafts_total == 0:
            append_sampled(seqs, out, logprobs)
            events = self.scheduler.update(plan, out.sampled)
            if seqs is not live:  # stand-ins drop out here
                seqs = [s for s in live if s is not None]
            self.num_generated_tokens += len(seqs)
        else:
            events = self.scheduler.update(plan, out.sampled, None, drafts)
            seqs, gained = Speculator.append_verified(plan, events, out, logprobs, self._seqs)
            self.num_generated_tokens += gained
        self.latest_stats = events.stats
        self._apply_events(events)
        if batch.grammar is not None:
            seqs = self._advance_grammars(seqs)
        return seqs

    def _advance_grammars(self, seqs: list[SequenceState]) -> list[SequenceState]:
        """The matchers take the new tokens; a sequence whose grammar
        completed ends ("stop"), one whose grammar reached a dead end ends
        without the refused token ("error")."""
        advance = self.grammar.advance(seqs)
        self.num_generated_tokens -= advance.num_dropped
        for seq in advance.completed:
            self._stop(seq)
            seq.finish_reason = "stop"
        for seq in advance.dead_ends:
            self._stop(seq)
            seq.finish_reason = "error"
        return seqs

    def _outputs(self, seqs: list[SequenceState]) -> list[SequenceDelta]:
        """The step's deltas; siblings start, finished requests are forgotten."""
        deltas = [delta_of(seq) for seq in seqs if seq.is_finished or not seq.request.final_only]
        self._start_siblings(seqs)
        for seq in seqs:
            if seq.is_finished and seq.request.is_finished:
                self._forget(seq.request)
        return deltas

    def _note_first_schedules(self, plan: BatchPlan) -> None:
        """A row seen for the first time: when it was scheduled, and the
        prompt tokens the prefix cache served (computed before its chunk).
        Any row may be one (a prompt whose cache hit leaves one token to
        compute is planned as a decode row); a step with no sequence waiting
        for its first plan looks at none."""
        unscheduled = self._unscheduled
        if not unscheduled:
            return
        req_ids, computed = plan.req_ids, plan.num_computed_tokens
        t_now = None
        for row in range(plan.num_reqs):
            sid = int(req_ids[row])
            if sid not in unscheduled:
                continue
            unscheduled.discard(sid)
            seq = self._seqs.get(sid)
            if seq is not None:
                seq.num_cached_tokens = int(computed[row])
                req = seq.request
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = t_now = t_now or now()

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


@dataclass
class _Compiling:
    """A request waiting for its grammar to compile."""

    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    final_only: bool
    grammar: PendingGrammar
    adapter: int = 0  # its LoRA adapter's internal id, held while it waits
    images: RequestImages | None = None


def _keep_pooled(live: list[SequenceState | None], rows: list[int], out: RunnerOutput) -> None:
    """Each pooled row's output becomes its sequence's `embedding`: a unit
    (when asked) hidden state, or a classifier's probabilities (when asked)
    or logits."""
    assert out.pooled is not None
    for row, vector in zip(rows, out.pooled, strict=True):
        seq = live[row]
        assert seq is not None and seq.params.pooling is not None
        pooling = seq.params.pooling
        values = vector.astype(np.float64)
        if pooling.dimensions is not None:
            values = values[: pooling.dimensions]
        if pooling.task == "embed" and pooling.normalize:
            values = values / max(float(np.linalg.norm(values)), 1e-12)
        elif pooling.task == "classify" and pooling.activation:
            if len(values) == 1:
                values = 1.0 / (1.0 + np.exp(-values))
            else:
                values = np.exp(values - values.max())
                values = values / values.sum()
        seq.embedding = values.astype(np.float32).tolist()
