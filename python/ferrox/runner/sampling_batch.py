"""Per-row sampling parameters of one step, gathered into tensors once so the
sampler works on the whole batch at a time.

The engine counts its live sequences per sampling feature (`FeatureCounts`);
a feature no live sequence uses costs a step nothing, not even a look at
each row's parameters. A batch of greedy requests without penalties, bias,
min_tokens or logprobs is built in O(1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from ferrox.sampling_params import SamplingParams


class SampledSequence(Protocol):
    """What the sampler needs to know of a sequence."""

    params: SamplingParams
    seed: int | None  # a seeded sequence's own random stream, in [0, 2**64)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    min_tokens_blocked_ids: list[int]  # EOS / stop ids masked until min_tokens


def sampling_features(params: SamplingParams) -> Iterable[str]:
    """The optional sampling steps a request needs."""
    if not params.is_greedy:
        yield "random"
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        yield "penalties"
    if params.logit_bias:
        yield "logit_bias"
    if params.min_tokens:
        yield "min_tokens"
    if params.logprobs is not None:
        yield "logprobs"


FEATURES = ("random", "penalties", "logit_bias", "min_tokens", "logprobs")


class FeatureCounts:
    """Live sequences per sampling feature."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def add(self, params: SamplingParams, sign: int = 1) -> None:
        for feature in sampling_features(params):
            self._counts[feature] += sign

    def __contains__(self, feature: str) -> bool:
        return self._counts[feature] > 0


@dataclass
class SeededRows:
    rows: torch.Tensor  # [R] int64, rows with a seed of their own
    seeds: torch.Tensor  # [R] int64 (the seed's 64 bits)
    positions: torch.Tensor  # [R] int64, the output position sampled


@dataclass
class TopKTopP:
    """The rows that keep only their k best tokens and / or the smallest set
    reaching probability p; the other rows skip the sort."""

    rows: torch.Tensor  # [F] int64
    top_k: torch.Tensor  # [F] int64 (vocab size where off)
    max_top_k: int  # the largest k among the rows (known on the host: no device sync)
    top_p: torch.Tensor | None  # [F] float32 (1.0 where off); None when no row uses it


@dataclass
class RandomSampling:
    temperature: torch.Tensor  # [S] float32, 1.0 on greedy rows
    is_greedy: torch.Tensor  # [S] bool
    top_k_top_p: TopKTopP | None = None
    min_p: torch.Tensor | None = None  # [S] float32
    seeded: SeededRows | None = None


@dataclass
class Penalties:
    """Repetition, frequency and presence penalties of the rows that use any."""

    rows: torch.Tensor  # [P] int64
    repetition: torch.Tensor  # [P]
    frequency: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    output_counts: torch.Tensor  # [P, V] float32
    prompt_mask: torch.Tensor  # [P, V] bool, prompt tokens of repetition-penalised rows


@dataclass
class SparseLogits:
    rows: torch.Tensor  # [n] int64
    tokens: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] float32


@dataclass
class SamplingBatch:
    num_rows: int
    random: RandomSampling | None = None  # None: every row is greedy
    penalties: Penalties | None = None
    bias: SparseLogits | None = None  # added to the logits
    blocked: SparseLogits | None = None  # set to -inf (min_tokens)
    max_num_logprobs: int = -1  # -1: no row wants logprobs

    @property
    def all_greedy(self) -> bool:
        return self.random is None

    @classmethod
    def build(
        cls,
        seqs: Sequence[SampledSequence],
        vocab_size: int,
        device: torch.device,
        features: FeatureCounts | None = None,
    ) -> SamplingBatch:
        """`features`: what the live sequences use (None: look at every row)."""
        active = set(FEATURES) if features is None else {f for f in FEATURES if f in features}
        batch = cls(num_rows=len(seqs))
        if not active:
            return batch
        params = [s.params for s in seqs]

        def col(values: list[Any], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        if "random" in active:
            batch.random = _random_sampling(seqs, vocab_size, col)
        if "penalties" in active:
            batch.penalties = _penalties(seqs, vocab_size, col)
        if "logit_bias" in active:
            batch.bias = _sparse(
                [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()],
                col,
            )
        if "min_tokens" in active:
            batch.blocked = _sparse(
                [
                    (i, t, float("-inf"))
                    for i, s in enumerate(seqs)
                    if len(s.output_token_ids) < s.params.min_tokens
                    for t in s.min_tokens_blocked_ids
                ],
                col,
            )
        if "logprobs" in active:
            batch.max_num_logprobs = max(
                (p.logprobs for p in params if p.logprobs is not None), default=-1
            )
        return batch


Column = Callable[..., torch.Tensor]


def _random_sampling(
    seqs: Sequence[SampledSequence], vocab_size: int, col: Column
) -> RandomSampling | None:
    params = [s.params for s in seqs]
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return None
    random = RandomSampling(
        temperature=col([1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]),
        is_greedy=col(greedy, torch.bool),
    )
    filtered = [
        i
        for i, p in enumerate(params)
        if not greedy[i] and (0 < p.top_k < vocab_size or p.top_p < 1.0)
    ]
    if filtered:
        ks = [
            min(params[i].top_k, vocab_size) if params[i].top_k > 0 else vocab_size
            for i in filtered
        ]
        ps = [params[i].top_p for i in filtered]
        random.top_k_top_p = TopKTopP(
            rows=col(filtered, torch.int64),
            top_k=col(ks, torch.int64),
            max_top_k=max(ks),
            top_p=col(ps) if any(p < 1.0 for p in ps) else None,
        )
    if any(p.min_p > 0.0 for p in params):
        random.min_p = col([p.min_p for p in params])
    seeded = [i for i, s in enumerate(seqs) if s.seed is not None and not greedy[i]]
    if seeded:
        random.seeded = SeededRows(
            rows=col(seeded, torch.int64),
            # The seed's 64 bits as a signed int64.
            seeds=col([_as_int64(cast(int, seqs[i].seed)) for i in seeded], torch.int64),
            positions=col([len(seqs[i].output_token_ids) for i in seeded], torch.int64),
        )
    return random


def _penalties(seqs: Sequence[SampledSequence], vocab_size: int, col: Column) -> Penalties | None:
    rows = [
        i
        for i, s in enumerate(seqs)
        if s.params.repetition_penalty != 1.0
        or s.params.frequency_penalty
        or s.params.presence_penalty
    ]
    if not rows:
        return None
    params = [seqs[i].params for i in rows]
    # One scatter for all penalised rows: output-token counts and prompt-token marks.
    outputs = [seqs[i].output_token_ids for i in rows]
    out_rows = [j for j, ids in enumerate(outputs) for _ in ids]
    out_ids = [t for ids in outputs for t in ids]
    counts = col([0.0]).new_zeros(len(rows), vocab_size)  # [P, V]
    if out_ids:
        counts.index_put_(
            (col(out_rows, torch.int64), col(out_ids, torch.int64)),
            col([1.0]).expand(len(out_ids)),
            accumulate=True,
        )
    prompts = [
        seqs[i].prompt_token_ids if p.repetition_penalty != 1.0 else []
        for i, p in zip(rows, params, strict=True)
    ]
    prompt_rows = [j for j, ids in enumerate(prompts) for _ in ids]
    prompt_ids = [t for ids in prompts for t in ids]
    prompt_mask = counts.new_zeros(len(rows), vocab_size, dtype=torch.bool)  # [P, V]
    if prompt_ids:
        prompt_mask[col(prompt_rows, torch.int64), col(prompt_ids, torch.int64)] = True
    return Penalties(
        rows=col(rows, torch.int64),
        repetition=col([p.repetition_penalty for p in params]),
        frequency=col([p.frequency_penalty for p in params]),
        presence=col([p.presence_penalty for p in params]),
        output_counts=counts,
        prompt_mask=prompt_mask,
    )


def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _sparse(entries: list[tuple[int, int, float]], col: Column) -> SparseLogits | None:
    if not entries:
        return None
    rows, tokens, values = zip(*entries, strict=True)
    return SparseLogits(
        col(list(rows), torch.int64), col(list(tokens), torch.int64), col(list(values))
    )
