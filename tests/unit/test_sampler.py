"""The batched sampler: counter-based noise for seeded rows, and batches built
only for the features live sequences use."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ferrox.common.sampling_params import SamplingParams
from ferrox.runner.sampler import Sampler, _top_k, _top_p, counter_uniform
from ferrox.runner.sampling_batch import (
    FeatureCounts,
    PenaltyState,
    RandomSampling,
    SamplingBatch,
    SamplingBatchBuilder,
    SeededRows,
    TopK,
    TopP,
)

CPU = torch.device("cpu")


@dataclass
class Seq:
    params: SamplingParams
    seed: int | None = None
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    min_tokens_blocked_ids: list[int] = field(default_factory=list)
    penalty_state: PenaltyState | None = None


def test_counter_uniforms_depend_only_on_seed_and_position() -> None:
    seeds = torch.tensor([7, 8, 7, -(2**63)]).repeat_interleave(5000)
    positions = torch.tensor([0, 0, 1, 5]).repeat_interleave(5000) + torch.arange(5000).repeat(4)
    u = counter_uniform(seeds, positions)  # [20000]
    assert bool(((u > 0) & (u <= 1)).all())
    assert torch.equal(u, counter_uniform(seeds.flip(0), positions.flip(0)).flip(0))
    rows = u.view(4, 5000)
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])
    # Uniform on (0, 1]: mean 1/2, variance 1/12, every tenth equally full.
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    deciles = torch.bincount((u * 10).clamp(max=9.99).long(), minlength=10) / len(u)
    assert bool(((deciles - 0.1).abs() < 0.01).all()), deciles


def test_seeded_rows_sample_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log()[None, :].repeat(4000, 1)  # [4000, 4]
    seeded = SeededRows(  # one seed, 4,000 positions
        rows=torch.arange(4000), seeds=torch.full((4000,), 11), positions=torch.arange(4000)
    )
    random = RandomSampling(
        temperature=torch.ones(4000), is_greedy=torch.zeros(4000, dtype=torch.bool), seeded=seeded
    )
    batch = SamplingBatch(num_rows=4000, random=random)
    tokens = Sampler()(logits, batch).sampled
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_a_seeded_row_ignores_its_neighbours_and_its_row() -> None:
    vocab = 50
    params = SamplingParams(temperature=1.0, seed=5)
    target = Seq(params, seed=5, output_token_ids=[3] * 9)
    logits = torch.randn(1, vocab)

    def sample(neighbours: int, row: int) -> int:
        seqs = [Seq(SamplingParams(temperature=0.7)) for _ in range(neighbours)]
        seqs.insert(row, target)
        rows = torch.randn(len(seqs), vocab)
        rows[row] = logits[0]
        batch = SamplingBatch.build(seqs, vocab, CPU)
        return int(Sampler()(rows, batch).sampled[row])

    assert len({sample(0, 0), sample(5, 2), sample(9, 9), sample(3, 1)}) == 1


def test_unused_features_build_nothing() -> None:
    features = FeatureCounts()
    greedy = SamplingParams(temperature=0.0)
    features.add(greedy)
    batch = SamplingBatch.build([Seq(greedy)] * 3, 10, CPU, features)
    assert batch.all_greedy and batch.penalties is None and batch.max_num_logprobs == -1

    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2)
    features.add(penalised)
    seqs = [Seq(greedy), Seq(penalised, output_token_ids=[4, 4, 7])]
    batch = SamplingBatch.build(seqs, 10, CPU, features)
    pen = batch.penalties
    assert pen is not None and batch.all_greedy and pen.rows.tolist() == [1]  # that row only
    assert pen.output_counts[0].tolist() == [0, 0, 0, 0, 2, 0, 0, 1, 0, 0]
    assert pen.prompt_mask[0, :4].tolist() == [False, True, True, True]
    assert batch.max_num_logprobs == 2
    # The next step counts only what was sampled since.
    seqs[1].output_token_ids.append(7)
    again = SamplingBatch.build(seqs, 10, CPU, features).penalties
    assert again is not None
    assert again.output_counts[0].tolist() == [0, 0, 0, 0, 2, 0, 0, 2, 0, 0]
    features.add(penalised, -1)
    assert "penalties" not in features and "logprobs" not in features


def test_a_batch_of_the_same_rows_reuses_their_parameters() -> None:
    """A steady decode rebuilds only what changes per step: a seeded row's
    position moves on, so its next token draws new noise, exactly as a batch
    built afresh would."""
    vocab = 40
    seeded = Seq(SamplingParams(temperature=1.0, seed=3, top_p=0.9), seed=3)
    seqs = [Seq(SamplingParams(temperature=0.5, top_k=5, logprobs=1)), seeded]
    builder = SamplingBatchBuilder(vocab, CPU)
    first = builder.build(seqs)
    assert first.random is not None and first.random.seeded is not None
    assert first.random.seeded.positions.tolist() == [0]
    seeded.output_token_ids.append(9)
    second = builder.build(seqs)
    assert second.random is not None and second.random.seeded is not None
    assert second.random.temperature is first.random.temperature  # reused
    assert second.random.top_p is first.random.top_p
    assert second.random.seeded.positions.tolist() == [1]  # refreshed
    assert second.max_num_logprobs == 1
    fresh = SamplingBatch.build(seqs, vocab, CPU)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    assert int(Sampler()(logits, second).sampled[1]) == int(Sampler()(logits, fresh).sampled[1])
    # Other rows (or the same in another order) build afresh.
    swapped = builder.build(seqs[::-1])
    assert swapped.random is not None and swapped.random.seeded is not None
    assert swapped.random.seeded.rows.tolist() == [0]
    assert swapped.random.temperature.tolist() == [1.0, 0.5]


def test_top_k_alone_matches_the_sorted_filter() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    ks = torch.tensor([1, 7, 300, 50, 2])
    rows = torch.arange(5)
    fast = _top_k(logits, TopK(rows, ks, max_k=300))
    sorted_ = _top_p(logits, TopP(rows, ks, torch.ones(5)))
    assert torch.equal(fast, sorted_)
    assert (fast > float("-inf")).sum(dim=-1).tolist() == ks.tolist()
    nucleus = _top_p(logits, TopP(rows, torch.full((5,), 300), torch.full((5,), 0.5)))
    probs = torch.softmax(logits, -1)
    kept = probs.masked_fill(nucleus == float("-inf"), 0)
    assert bool((kept.sum(-1) >= 0.5).all())  # reaches p ...
    # ... and is the smallest such set: without its least likely token it would not.
    least = kept.masked_fill(kept == 0, 2.0).min(dim=-1).values
    assert bool((kept.sum(-1) - least < 0.5).all())
