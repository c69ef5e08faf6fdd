"""Batched sampling: logit bias, min-tokens masking, penalties, temperature,
top-k / top-p / min-p, then greedy or seeded random choice, plus logprobs.

Random rows use the exponential-race form of sampling (argmax of p / E with
E ~ Exp(1)): a row with its own generator draws its own E, so a seeded
request samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox.runner.sampling_batch import SamplingBatch


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
        if not batch.all_greedy:
            sampled = torch.where(batch.is_greedy, sampled, self._sample_random(logits, batch))
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None, None)
        sampled_lp = raw_logprobs.gather(1, sampled[:, None]).squeeze(1)  # [S]
        ranks = (raw_logprobs > sampled_lp[:, None]).sum(dim=-1) + 1
        k = batch.max_num_logprobs
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return SamplerOutput(sampled, sampled_lp, ranks, top_ids, top_lp)

    def _process(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        needs_copy = (
            b.bias_rows is not None or b.blocked_rows is not None or b.output_counts is not None
        )
        if needs_copy:
            logits = logits.clone()
        if b.bias_rows is not None:
            logits.index_put_((b.bias_rows, b.bias_tokens), b.bias_values, accumulate=True)
        if b.blocked_rows is not None:
            logits[b.blocked_rows, b.blocked_tokens] = float("-inf")
        if b.output_counts is not None:
            counts = b.output_counts  # [S, V]
            seen = (counts > 0) | b.prompt_mask
            rep = b.repetition_penalty[:, None]  # [S, 1]
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalised, logits)
            logits = logits - b.frequency_penalty[:, None] * counts
            logits = logits - b.presence_penalty[:, None] * (counts > 0).float()
        return logits

    def _sample_random(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        logits = logits / b.temperature[:, None]
        if b.top_k is not None or b.top_p is not None:
            logits = _top_k_top_p(logits, b.top_k, b.top_p)
        probs = torch.softmax(logits, dim=-1)  # [S, V]
        if b.min_p is not None:
            threshold = probs.max(dim=-1, keepdim=True).values * b.min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in b.generators:
            noise[row].exponential_(generator=gen)
        return (probs / noise).max(dim=-1).indices


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    # logits: [S, V]; keeps each row's k best and the smallest set reaching p.
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        sorted_logits = sorted_logits.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
