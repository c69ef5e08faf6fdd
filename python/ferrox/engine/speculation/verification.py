"""Verification: the sampling rows of a step that verifies drafts, and the
tokens each sequence keeps afterwards.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrox._native import BatchPlan
from ferrox.common.sampling_params import SamplingParams
from ferrox.runner.sampling_batch import PenaltyState


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
