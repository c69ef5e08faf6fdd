"""Batched sampling: logit bias, min-tokens masking, penalties, temperature,
top-k / top-p / min-p, then greedy or seeded random choice, plus logprobs.

Random rows use the exponential-race form of sampling (argmax of p / E with
E ~ Exp(1)). Unseeded rows draw E as -log(U) from torch's generator.
Top-k / top-p and penalties run on the rows that use them only. Seeded rows draw
it from a counter-based hash of (seed, output position, token id), all rows
in one batched operation: a seeded request samples the same tokens whatever
else shares the batch, offline or through the server, with no per-row work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox.runner.sampling_batch import RandomSampling, SamplingBatch, TopKTopP


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [S] int64
    sampled_logprobs: torch.Tensor | None  # [S] float32
    sampled_ranks: torch.Tensor | None  # [S] int64, 1 = most likely
    top_ids: torch.Tensor | None  # [S, k] int64
    top_logprobs: torch.Tensor | None  # [S, k] float32


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [S, V] float32, straight from the model.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs >= 0 else None
        logits = self._process(logits, batch)
        sampled = logits.max(dim=-1).indices  # first maximum, like argmax, but faster
        if batch.random is not None:
            random = self._sample_random(logits, batch.random)
            sampled = torch.where(batch.random.is_greedy, sampled, random)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None, None)
        sampled_lp = raw_logprobs.gather(1, sampled[:, None]).squeeze(1)  # [S]
        ranks = (raw_logprobs > sampled_lp[:, None]).sum(dim=-1) + 1
        k = batch.max_num_logprobs
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return SamplerOutput(sampled, sampled_lp, ranks, top_ids, top_lp)

    def _process(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        if b.bias is not None or b.blocked is not None or b.penalties is not None:
            logits = logits.clone()
        if b.bias is not None:
            logits.index_put_((b.bias.rows, b.bias.tokens), b.bias.values, accumulate=True)
        if b.blocked is not None:
            logits[b.blocked.rows, b.blocked.tokens] = b.blocked.values
        if (pen := b.penalties) is not None:
            rows = logits[pen.rows]  # [P, V]
            counts = pen.output_counts
            seen = (counts > 0) | pen.prompt_mask
            rep = pen.repetition[:, None]  # [P, 1]
            rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
            rows = rows - pen.frequency[:, None] * counts
            rows = rows - pen.presence[:, None] * (counts > 0).float()
            logits[pen.rows] = rows
        return logits

    def _sample_random(self, logits: torch.Tensor, r: RandomSampling) -> torch.Tensor:
        logits = logits / r.temperature[:, None]
        if (f := r.top_k_top_p) is not None:
            logits[f.rows] = _top_k_top_p(logits[f.rows], f)
        probs = torch.softmax(logits, dim=-1)  # [S, V]
        if r.min_p is not None:
            threshold = probs.max(dim=-1, keepdim=True).values * r.min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Exp(1) noise as -log(U); U == 0 gives infinite noise: that token loses.
        noise = torch.rand_like(probs).log_().neg_()  # [S, V]
        if (seeded := r.seeded) is not None:
            vocab = probs.shape[-1]
            noise[seeded.rows] = counter_exponential(seeded.seeds, seeded.positions, vocab)
        return (probs / noise).max(dim=-1).indices


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic;
# int64 multiplication wraps modulo 2**64 alike).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def counter_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise that depends only on (seed, position, token id).

    seeds, positions: [R] int64 -> [R, V] float32.
    """
    key = _mix64(_mix64(seeds) + positions * _GOLDEN)  # [R]
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)  # [V]
    bits = _mix64(key[:, None] + (token[None, :] + 1) * _GOLDEN)  # [R, V]
    # The top 24 bits as a uniform in (0, 1), then the inverse CDF.
    uniform = (_shift_right(bits, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


def _top_k_top_p(logits: torch.Tensor, f: TopKTopP) -> torch.Tensor:
    """logits: [F, V] -> the same with the tokens outside each row's top-k /
    top-p set at -inf."""
    vocab = logits.shape[-1]
    if f.top_p is None:
        # Top-k alone: the k-th best value is each row's threshold (ties stay).
        kth = logits.topk(f.max_top_k, dim=-1).values.gather(1, f.top_k[:, None] - 1)  # [F, 1]
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= f.top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
    sorted_logits = sorted_logits.masked_fill(before > f.top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
