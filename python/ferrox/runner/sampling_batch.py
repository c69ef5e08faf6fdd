"""Per-row sampling parameters of one step, gathered into tensors once so the
sampler works on the whole batch at a time.

The engine counts its live sequences per sampling feature (`FeatureCounts`);
a feature no live sequence uses costs a step nothing, not even a look at
each row's parameters. A batch of greedy requests without penalties, bias,
min_tokens or logprobs is built in O(1), and a batch of the same sequences
as the step before reuses what depends on their parameters alone.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from ferrox.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrox.runner.token_bitmask import GrammarMask


class SampledSequence(Protocol):
    """What the sampler needs to know of a sequence."""

    params: SamplingParams
    seed: int | None  # a seeded sequence's own random stream, in [0, 2**64)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    min_tokens_blocked_ids: list[int]  # EOS / stop ids masked until min_tokens
    penalty_state: PenaltyState | None  # kept between steps by the batch builder


@dataclass
class PenaltyState:
    """A penalised sequence's token counts, kept between steps so that each
    step adds only the tokens sampled since the last."""

    output_counts: torch.Tensor  # [V] float32
    prompt_mask: torch.Tensor  # [V] bool (all False without a repetition penalty)
    num_counted: int = 0


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
    if params.structured_outputs is not None:
        yield "grammar"
    if params.pooling is not None:
        yield "pooling"


# The features the batch builder reads (the grammar's masks come from the engine).
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

    def any(self) -> bool:
        """Whether a live sequence uses any optional feature."""
        return any(n > 0 for n in self._counts.values())


@dataclass
class SeededRows:
    rows: torch.Tensor  # [R] int64, rows with a seed of their own
    seeds: torch.Tensor  # [R] int64 (the seed's 64 bits)
    positions: torch.Tensor  # [R] int64, the output position sampled


@dataclass
class TopK:
    """Rows that keep only their k best tokens (and use no top-p)."""

    rows: torch.Tensor  # [F] int64
    k: torch.Tensor  # [F] int64
    max_k: int  # the largest k among them (known on the host: no device sync)


@dataclass
class TopP:
    """Rows that keep the smallest set of tokens reaching probability p,
    within their k best (vocabulary size where top-k is off)."""

    rows: torch.Tensor  # [F] int64
    k: torch.Tensor  # [F] int64
    p: torch.Tensor  # [F] float32


@dataclass
class RandomSampling:
    temperature: torch.Tensor  # [S] float32, 1.0 on greedy rows
    is_greedy: torch.Tensor  # [S] bool
    top_k: TopK | None = None
    top_p: TopP | None = None
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
    grammar: GrammarMask | None = None  # tokens outside each row's grammar set to -inf
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
        return SamplingBatchBuilder(vocab_size, device).build(seqs, features)


class SamplingBatchBuilder:
    """Builds each step's SamplingBatch. The parts that depend only on which
    sequences the batch holds, in which order (temperatures, top-k / top-p /
    min-p, seeds, logit bias, logprobs: a steady decode's batch is the same
    from step to step) are reused while the rows are the same objects; the
    parts that change every step (seeded rows' positions, penalty counts,
    min_tokens masks) are built every step."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._rows: list[SampledSequence] = []  # held, so their ids stay theirs
        self._active: set[str] = set()
        self._random: RandomSampling | None = None
        self._seeded: list[int] = []  # rows of self._random.seeded, on the host
        self._bias: SparseLogits | None = None
        self._max_num_logprobs = -1

    def _col(self, values: list[Any], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _same_rows(self, seqs: Sequence[SampledSequence], active: set[str]) -> bool:
        return (
            active == self._active
            and len(seqs) == len(self._rows)
            and all(a is b for a, b in zip(seqs, self._rows, strict=True))
        )

    def build(
        self, seqs: Sequence[SampledSequence], features: FeatureCounts | None = None
    ) -> SamplingBatch:
        """`features`: what the live sequences use (None: look at every row)."""
        active = set(FEATURES) if features is None else {f for f in FEATURES if f in features}
        batch = SamplingBatch(num_rows=len(seqs))
        if not active:
            return batch
        col = self._col
        if not self._same_rows(seqs, active):
            self._rows, self._active = list(seqs), active
            self._random = (
                _random_sampling(seqs, self.vocab_size, col) if "random" in active else None
            )
            seeded = self._random.seeded if self._random is not None else None
            self._seeded = [] if seeded is None else seeded.rows.tolist()
            params = [s.params for s in seqs]
            self._bias = None
            if "logit_bias" in active:
                self._bias = _sparse(
                    [
                        (i, t, v)
                        for i, p in enumerate(params)
                        for t, v in (p.logit_bias or {}).items()
                    ],
                    col,
                )
            self._max_num_logprobs = -1
            if "logprobs" in active:
                self._max_num_logprobs = max(
                    (p.logprobs for p in params if p.logprobs is not None), default=-1
                )
        elif self._random is not None and self._random.seeded is not None:
            positions = col([len(seqs[i].output_token_ids) for i in self._seeded], torch.int64)
            seeded = dataclasses.replace(self._random.seeded, positions=positions)
            self._random = dataclasses.replace(self._random, seeded=seeded)
        batch.random = self._random
        batch.bias = self._bias
        batch.max_num_logprobs = self._max_num_logprobs
        if "penalties" in active:
            batch.penalties = _penalties(seqs, self.vocab_size, col)
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
    ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    nucleus = [i for i, p in enumerate(params) if not greedy[i] and p.top_p < 1.0]
    only_k = [
        i for i, p in enumerate(params) if not greedy[i] and p.top_p >= 1.0 and ks[i] < vocab_size
    ]
    if only_k:
        random.top_k = TopK(
            rows=col(only_k, torch.int64),
            k=col([ks[i] for i in only_k], torch.int64),
            max_k=max(ks[i] for i in only_k),
        )
    if nucleus:
        random.top_p = TopP(
            rows=col(nucleus, torch.int64),
            k=col([ks[i] for i in nucleus], torch.int64),
            p=col([params[i].top_p for i in nucleus]),
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
    states: list[PenaltyState] = []
    new_rows: list[int] = []
    new_ids: list[int] = []
    for j, i in enumerate(rows):
        seq = seqs[i]
        state = seq.penalty_state
        if state is None:
            prompt_mask = col([False], torch.bool).new_zeros(vocab_size)  # [V]
            if seq.params.repetition_penalty != 1.0:
                prompt_mask[col(seq.prompt_token_ids, torch.int64)] = True
            zeros = col([0.0]).new_zeros(vocab_size)  # [V]
            state = seq.penalty_state = PenaltyState(zeros, prompt_mask)
        fresh = seq.output_token_ids[state.num_counted :]
        new_rows += [j] * len(fresh)
        new_ids += fresh
        state.num_counted += len(fresh)
        states.append(state)
    counts = torch.stack([s.output_counts for s in states])  # [P, V]
    if new_ids:  # one scatter for every penalised row's new tokens
        counts.index_put_(
            (col(new_rows, torch.int64), col(new_ids, torch.int64)),
            col([1.0]).expand(len(new_ids)),
            accumulate=True,
        )
    for j, state in enumerate(states):
        state.output_counts = counts[j]  # a view: the next step starts from here
    params = [seqs[i].params for i in rows]
    return Penalties(
        rows=col(rows, torch.int64),
        repetition=col([p.repetition_penalty for p in params]),
        frequency=col([p.frequency_penalty for p in params]),
        presence=col([p.presence_penalty for p in params]),
        output_counts=counts,
        prompt_mask=torch.stack([s.prompt_mask for s in states]),  # [P, V]
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
