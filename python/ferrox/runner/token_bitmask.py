"""The sampler's side of structured outputs: a step's grammar mask (the
rows a grammar constrains and their bitmask, still being computed on a
worker thread while the model runs) and the kernel that applies it.

The grammar engine (`ferrox.engine.structured_output`) fills the masks; the sampler
waits for them and sets every token outside a row's mask to -inf.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ferrox._native import apply_token_bitmask_cpu

BITS_PER_WORD = 32


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
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))
