"""The step-cost model that adaptive speculation weighs draft tokens by."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ferrox._native import Scheduler

# Steps between two updates of the scheduler's cost model.
COST_UPDATE_INTERVAL = 4
# Weight of older steps in the cost fit (per step).
COST_DECAY = 0.97


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
