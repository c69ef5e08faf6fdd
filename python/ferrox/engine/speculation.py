"""The engine's side of speculative decoding: the sampling rows of a
verification, and the step-cost model that adaptive speculation weighs
draft tokens by.

A row that verifies d drafts samples d + 1 positions. Position j is sampled
as if drafts 1..j were already output: a `DraftView` of the sequence with
those tokens appended, so that penalties, min_tokens, seeds (keyed by
output position), grammar masks and logprobs are those plain decoding would
use at that position. The scheduler keeps the samples up to the first that
differs from its draft: for single-token proposals that is exact rejection
sampling, and a seeded request gives the same tokens with or without
speculation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrox._native import BatchPlan, Scheduler
from ferrox.config import EngineConfig
from ferrox.errors import InvalidArgumentError
from ferrox.loader.model_loader import LoadedModel, load_model
from ferrox.runner.sampling_batch import PenaltyState
from ferrox.sampling_params import SamplingParams

# Steps between two updates of the scheduler's cost model.
COST_UPDATE_INTERVAL = 4
# Weight of older steps in the cost fit (per step).
COST_DECAY = 0.97


def load_draft_model(config: EngineConfig, vocab_size: int) -> LoadedModel:
    """The draft model of `speculative_config`, on the target's device and dtype."""
    spec = config.speculation
    assert spec is not None and spec.model is not None
    draft_config = dataclasses.replace(
        config, model=spec.model, load_format=spec.load_format, tokenizer=None
    )
    draft = load_model(draft_config)
    draft_vocab = int(draft.hf_config.vocab_size)
    if draft_vocab != vocab_size:
        raise InvalidArgumentError(
            f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
            f"({vocab_size}); a draft model must share the target's tokenizer"
        )
    return draft


@dataclass
class DraftView:
    """A sequence as it would be after its first j drafts (for sampling)."""

    params: SamplingParams
    seed: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    min_tokens_blocked_ids: list[int]
    penalty_state: PenaltyState | None = None  # counted afresh for the view
    grammar: Any = None


def row_drafts(plan: BatchPlan) -> dict[int, np.ndarray]:
    """Each speculating row's draft tokens (from the plan's input ids)."""
    qsl = plan.query_start_loc
    out = {}
    for row in np.flatnonzero(plan.num_draft_tokens).tolist():
        d = int(plan.num_draft_tokens[row])
        end = int(qsl[row + 1])
        out[row] = plan.input_ids[end - d : end]
    return out


def sampling_rows(plan: BatchPlan, seqs: Sequence[Any]) -> tuple[list[Any], list[list[int]]]:
    """The rows to sample, one per logits index: a speculating sequence's
    first position is the sequence itself, its j-th a DraftView; and, per
    row, the drafts the view has consumed (for grammar masks)."""
    drafts = row_drafts(plan)
    rows: list[Any] = []
    prefixes: list[list[int]] = []
    previous = -1
    j = 0
    for seq, row in zip(seqs, plan.sample_rows.tolist(), strict=True):
        j = j + 1 if row == previous else 0
        previous = row
        if j == 0:
            rows.append(seq)
            prefixes.append([])
            continue
        prefix = drafts[row][:j].tolist()
        rows.append(
            DraftView(
                params=seq.params,
                seed=seq.seed,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids + prefix,
                min_tokens_blocked_ids=seq.min_tokens_blocked_ids,
            )
        )
        prefixes.append(prefix)
    return rows, prefixes


@dataclass
class StepCostModel:
    """Fits step time = a + b * tokens + c * sampled positions over recent
    steps (exponentially weighted least squares; a sampled position adds an
    LM-head row and its sampling) and tells the scheduler every few steps:
    a, the cost b + c of a token that is sampled (a decode, a draft), and the
    draft model's seconds per draft token. Until the steps' sizes have varied
    enough to separate the terms, the fit is the least-norm one (a decode-only
    history gives a right a + (b + c) N); at first, a is the mean step time
    and b = c = 0: n-gram drafts then look free, a draft model's cost counts
    from its first step."""

    scheduler: Scheduler
    # Weighted moments of (1, tokens, sampled) and of the step time.
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _steps: int = 0
    draft_seconds: float = 0.0  # per draft token (EMA), 0 for n-gram
    fitted: tuple[float, float] | None = None  # (a, b + c)

    def observe(self, num_tokens: int, num_sampled: int, seconds: float) -> None:
        x = np.array([1.0, float(num_tokens), float(num_sampled)])
        self._xx *= COST_DECAY
        self._xy *= COST_DECAY
        self._xx += np.outer(x, x)
        self._xy += x * seconds
        self._steps += 1
        if self._steps % COST_UPDATE_INTERVAL == 0:
            self._refit()

    def observe_drafts(self, num_drafts: int, seconds: float) -> None:
        if num_drafts:
            per = seconds / num_drafts
            self.draft_seconds = (
                per if not self.draft_seconds else 0.8 * self.draft_seconds + 0.2 * per
            )
            if self.fitted is None:  # the draft's cost matters from the first step
                self._refit()

    def _refit(self) -> None:
        w = self._xx[0, 0]
        if w <= 0:
            return
        coef = np.linalg.lstsq(self._xx, self._xy, rcond=1e-9)[0]
        a, b, c = (float(v) for v in coef)
        sampled_token = max(b + c, 0.0)
        if a < 0 or b + c < 0:  # no sensible slope yet: the mean step
            a, sampled_token = self._xy[0] / w, 0.0
        self.fitted = (a, sampled_token)
        self.scheduler.set_spec_cost(a, sampled_token, self.draft_seconds)
