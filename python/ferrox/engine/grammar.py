"""The grammar engine of structured outputs (llguidance).

Each constrained sequence holds a matcher: the grammar's parser state over
the tokens it has sampled. Before the model runs, the step's matchers
write their next-token masks (one bit per vocabulary entry) into one batch
bitmask on a worker thread; llguidance computes them in Rust without the
GIL, so the masks are ready by the time the forward pass has produced
logits. The sampler then sets every token outside a row's mask to -inf.
After sampling each matcher consumes its token; a matcher that accepts
nothing more but the end of sequence ends its sequence.

Compiled grammars are cached by their source: a request with the same
schema as an earlier one copies the compiled matcher instead of compiling.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ferrox._native import apply_token_bitmask_cpu
from ferrox.errors import InvalidArgumentError
from ferrox.structured_outputs import StructuredOutputsParams, check_grammar

CACHE_SIZE = 256
_BITS = 32


@dataclass
class GrammarStats:
    """Where structured outputs spend a step's time (summed over steps)."""

    steps: int = 0
    fill_seconds: float = 0.0  # computing masks, on the worker, while the model runs
    wait_seconds: float = 0.0  # the sampler waiting for them
    apply_seconds: float = 0.0  # setting disallowed logits to -inf
    advance_seconds: float = 0.0  # matchers consuming the sampled tokens


class GrammarMask:
    """The rows of a step that a grammar constrains, and their bitmask
    ([G, ceil(V / 32)] int32), which a worker thread is still computing."""

    def __init__(
        self,
        rows: list[int],
        future: Future[torch.Tensor],
        device: torch.device,
        stats: GrammarStats | None = None,
    ) -> None:
        self.rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self._future = future
        self._device = device
        self._stats = stats or GrammarStats()

    def bitmask(self) -> torch.Tensor:
        start = time.perf_counter()
        bitmask = self._future.result().to(self._device, non_blocking=True)
        self._stats.wait_seconds += time.perf_counter() - start
        return bitmask

    def apply(self, logits: torch.Tensor) -> None:
        """Waits for the bitmask and applies it to logits [S, V] in place."""
        bitmask = self.bitmask()
        start = time.perf_counter()
        apply_token_bitmask(logits, self.rows, bitmask)
        self._stats.apply_seconds += time.perf_counter() - start


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets logits[rows] to -inf wherever the row's bit is 0 (in place; on
    the CPU a native kernel that skips words with every bit set).

    logits: [S, V] float32; rows: [G] int64; bitmask: [G, W] int32, W * 32 >= V.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        apply_token_bitmask_cpu(
            logits.numpy(), rows.contiguous().numpy(), bitmask.contiguous().numpy()
        )
        return
    apply_token_bitmask_torch(logits, rows, bitmask)


def apply_token_bitmask_torch(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> None:
    """`apply_token_bitmask` in torch operations (any device)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))


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
        """The compiled matcher of `params`' constraint, shared through the
        cache: `deep_copy` it for each sequence. Raises InvalidArgumentError
        naming the field when it does not compile. Called from the engine's
        thread only (the worker thread only fills masks)."""
        from llguidance import LLMatcher

        source = check_grammar(params)
        compiled = self._compiled.get(source)
        if compiled is not None:
            self._compiled.move_to_end(source)
            self.num_cache_hits += 1
            return compiled
        compiled = LLMatcher(self._llg_tokenizer(), source, log_level=0)
        if compiled.is_error():
            raise InvalidArgumentError(
                f"{params.param} does not compile: {compiled.get_error().strip()}"
            )
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

        words = (self._vocab_size + _BITS - 1) // _BITS
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
