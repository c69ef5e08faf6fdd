"""The grammar engine of structured outputs (llguidance).

Each constrained sequence holds a matcher: the grammar's parser state over
the tokens it has sampled. Before the model runs, the step's matchers
write their next-token masks (one bit per vocabulary entry) into one batch
bitmask on a worker thread; llguidance computes them in Rust without the
GIL, so the masks are ready by the time the forward pass has produced
logits. The sampler then sets every token outside a row's mask to -inf.
After sampling each matcher consumes its token; a matcher that accepts
nothing more but the end of sequence ends its sequence, and one that allows
no token at all (a dead end) ends it with finish reason "error".

Grammars compile on a thread of their own, off the engine's step: a request
whose grammar is new waits, outside the scheduler, until it has compiled
(at most `COMPILE_TIMEOUT_S`), while the step goes on. Compiled grammars are
cached by their source: a request with the same schema as an earlier one
copies the compiled matcher instead of compiling.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.structured_outputs import (
    StructuredOutputsParams,
    check_grammar,
    grammar_text,
)
from ferrox.runner.token_bitmask import BITS_PER_WORD, GrammarMask, GrammarStats

logger = logging.getLogger("ferrox")

CACHE_SIZE = 256
# A request whose grammar has not compiled after this long fails with a 400.
COMPILE_TIMEOUT_S = 30.0


class GrammarEngine:
    """Compiles structured-output constraints against the model's
    vocabulary and computes the masks of a step."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None  # llguidance's view of the vocabulary, built on first use
        self._executor: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrox-grammar")
        # Grammars compile here, off the step; one thread: llguidance's view of
        # the vocabulary is built once, by the first compile.
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrox-compile")
        self._inflight: dict[str, Future[Any]] = {}
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.stats = GrammarStats()

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._hf_tokenizer is None:
                raise InvalidArgumentError(
                    "structured outputs need the model's tokenizer; this model has none"
                )
            import llguidance
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
            except ValueError as e:
                raise InvalidArgumentError(
                    f"structured outputs are not available for this tokenizer: {e}"
                ) from None
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """The compiled matcher of `params`' constraint, compiled here if
        the cache lacks it (`deep_copy` it for each sequence). Raises
        InvalidArgumentError naming the field when it does not compile.
        Called from the engine's thread only."""
        compiled = self.cached(params)
        if compiled is None:
            compiled = self._store(grammar_text(params), self._check_and_compile(params))
        return compiled

    def cached(self, params: StructuredOutputsParams) -> Any | None:
        """The compiled matcher of `params`' constraint if the cache holds
        it, else None."""
        source = grammar_text(params)
        compiled = self._compiled.get(source)
        if compiled is not None:
            self._compiled.move_to_end(source)
            self.num_cache_hits += 1
        return compiled

    def compile_later(self, params: StructuredOutputsParams) -> PendingGrammar:
        """Checks and compiles `params`' constraint on the compile thread,
        off the engine's step (`ready` says when it is done). Requests with
        one source share one compile."""
        source = grammar_text(params)
        future = self._inflight.get(source)
        if future is None:
            future = self._compiler.submit(self._check_and_compile, params)
            self._inflight[source] = future
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        return PendingGrammar(source, params.param, future, deadline, COMPILE_TIMEOUT_S)

    def _check_and_compile(self, params: StructuredOutputsParams) -> Any:
        return self._compile(check_grammar(params), params.param)

    def ready(self, pending: PendingGrammar) -> Any | None:
        """The compiled matcher once `pending` has compiled (now in the
        cache), None while it compiles; raises InvalidArgumentError when it
        did not compile, or has not by its deadline. Engine thread only."""
        if not pending.future.done():
            if time.monotonic() <= pending.deadline:
                return None
            raise InvalidArgumentError(
                f"{pending.param} did not compile within {pending.timeout:g} s"
            )
        if self._inflight.get(pending.source) is pending.future:
            del self._inflight[pending.source]
        compiled = self._compiled.get(pending.source)
        if compiled is not None:  # another request's `ready` stored it
            self._compiled.move_to_end(pending.source)
            return compiled
        return self._store(pending.source, pending.future.result())

    @staticmethod
    def wait(pending: list[PendingGrammar], timeout: float) -> None:
        """Returns once one of `pending` has compiled, or after `timeout` s."""
        futures.wait([p.future for p in pending], timeout, futures.FIRST_COMPLETED)

    def _compile(self, source: str, param: str) -> Any:
        from llguidance import LLMatcher

        compiled = LLMatcher(self._llg_tokenizer(), source, log_level=0)
        if compiled.is_error():
            raise InvalidArgumentError(f"{param} does not compile: {compiled.get_error().strip()}")
        return compiled

    def _store(self, source: str, compiled: Any) -> Any:
        self.num_compiled += 1
        self._compiled[source] = compiled
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def masks(
        self, matchers: list[tuple[int, Any, list[int]]], device: torch.device
    ) -> GrammarMask:
        """Starts computing the next-token masks of (row, matcher, drafts)
        entries: a row's mask is its matcher's after it consumed `drafts`
        (the drafts before a verified position; empty for plain decoding)."""
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        words = (self._vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        plain = [(m, i) for i, (_, m, drafts) in enumerate(matchers) if not drafts]
        drafted = [(i, m, drafts) for i, (_, m, drafts) in enumerate(matchers) if drafts]

        stats = self.stats
        stats.steps += 1

        def fill() -> torch.Tensor:
            start = time.perf_counter()
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
            # After the parallel fill: these share matchers with plain rows.
            for i, matcher, drafts in drafted:
                # A refused draft: the mask of the state before it.
                consumed = matcher.validate_tokens(drafts)
                if consumed:
                    matcher.consume_tokens(drafts[:consumed])
                fill_next_token_bitmask(matcher, bitmask, i)
                if consumed:
                    matcher.rollback(consumed)
            stats.fill_seconds += time.perf_counter() - start
            return bitmask

        future = self._worker.submit(fill)
        return GrammarMask([row for row, _, _ in matchers], future, device, stats)

    def constrain(
        self, seqs: list[Any], prefixes: list[list[int]] | None, device: torch.device
    ) -> GrammarMask | None:
        """Starts the masks of a step's constrained rows (`seqs[i]` samples
        row i; `prefixes[i]`: the drafts its view has consumed), computed
        while the model runs; None when no row is constrained."""
        constrained = [
            (i, s.grammar, prefixes[i] if prefixes else [])
            for i, s in enumerate(seqs)
            if s.grammar is not None
        ]
        return self.masks(constrained, device) if constrained else None

    def advance(self, seqs: list[Any]) -> GrammarAdvance:
        """Each constrained sequence's matcher takes its new tokens. A
        complete grammar allows only EOS next, which ends the sequence in the
        scheduler; under `ignore_eos` the sequence ends here, and tokens
        verified past that EOS are dropped. A token the grammar refuses, or
        one sampled after the matcher found that no token continues the
        output (llguidance then allows only EOS), is a dead end: the
        sequence ends without that token."""
        start = time.perf_counter()
        result = GrammarAdvance()
        eos = self._eos_token_ids
        for seq in seqs:
            matcher = seq.grammar
            if matcher is None:
                continue
            output = seq.output_token_ids
            refused = False
            for i in range(seq.num_grammar_tokens, len(output)):
                if i and output[i - 1] in eos and matcher.is_stopped():
                    # Ended by its EOS under ignore_eos: tokens verified past it go.
                    result.num_dropped += len(output) - i
                    del output[i:]
                    break
                # An error state (found when the mask was computed) lets only EOS
                # through: that EOS does not complete the grammar.
                if matcher.is_error() or not matcher.consume_token(output[i]):
                    logger.warning(
                        "request %s: its grammar allows no token after %d output tokens (%s); "
                        "the sequence ends there",
                        seq.request.request_id,
                        i,
                        ((matcher.get_error() or "").strip().splitlines() or ["an empty mask"])[0],
                    )
                    result.num_dropped += len(output) - i
                    del output[i:]
                    refused = True
                    break
            seq.num_grammar_tokens = len(output)
            if refused:
                result.dead_ends.append(seq)
            elif not seq.is_finished and matcher.is_stopped() and output and output[-1] in eos:
                result.completed.append(seq)
        self.stats.advance_seconds += time.perf_counter() - start
        return result


@dataclass
class PendingGrammar:
    """A request's grammar compiling off the step (`GrammarEngine.compile_later`)."""

    source: str
    param: str  # the request field that holds it, for errors
    future: Future[Any]
    deadline: float  # time.monotonic()
    timeout: float  # seconds, for errors


@dataclass
class GrammarAdvance:
    """What the matchers' new tokens decided."""

    completed: list[Any] = field(default_factory=list)  # sequences the grammar ended
    dead_ends: list[Any] = field(default_factory=list)  # sequences no token can continue
    num_dropped: int = 0  # tokens removed: after an ending EOS, or refused
