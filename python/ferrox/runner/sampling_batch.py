"""Per-row sampling parameters of one step, gathered into tensors once so the
sampler works on the whole batch at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ferrox.sampling_params import SamplingParams


class SampledSequence(Protocol):
    """What the sampler needs to know of a sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    min_tokens_blocked_ids: list[int]  # EOS / stop ids masked until min_tokens


@dataclass
class SamplingBatch:
    num_rows: int
    all_greedy: bool
    temperature: torch.Tensor | None  # [S] float32, 1.0 on greedy rows
    is_greedy: torch.Tensor | None  # [S] bool
    top_k: torch.Tensor | None  # [S] int64 (vocab size where off)
    top_p: torch.Tensor | None  # [S] float32
    min_p: torch.Tensor | None  # [S] float32
    generators: list[tuple[int, torch.Generator]]  # seeded rows
    repetition_penalty: torch.Tensor | None  # [S]
    frequency_penalty: torch.Tensor | None  # [S]
    presence_penalty: torch.Tensor | None  # [S]
    output_counts: torch.Tensor | None  # [S, V] float32
    prompt_mask: torch.Tensor | None  # [S, V] bool
    bias_rows: torch.Tensor | None  # [nb] int64
    bias_tokens: torch.Tensor | None  # [nb] int64
    bias_values: torch.Tensor | None  # [nb] float32
    blocked_rows: torch.Tensor | None  # [nm] int64 (min_tokens masking)
    blocked_tokens: torch.Tensor | None  # [nm] int64
    max_num_logprobs: int  # -1: no row wants logprobs

    @classmethod
    def build(
        cls, seqs: Sequence[SampledSequence], vocab_size: int, device: torch.device
    ) -> SamplingBatch:
        params = [s.params for s in seqs]
        n = len(seqs)
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)

        def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = is_greedy = top_k = top_p = min_p = None
        generators: list[tuple[int, torch.Generator]] = []
        if not all_greedy:
            temperature = col(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
            )
            is_greedy = col(greedy, torch.bool)
            ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
            if any(k < vocab_size for k in ks):
                top_k = col(ks, torch.int64)
            if any(p.top_p < 1.0 for p in params):
                top_p = col([p.top_p for p in params])
            if any(p.min_p > 0.0 for p in params):
                min_p = col([p.min_p for p in params])
            generators = [(i, s.generator) for i, s in enumerate(seqs) if s.generator is not None]

        rep = freq = pres = counts = prompt_mask = None
        if any(
            p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params
        ):
            rep = col([p.repetition_penalty for p in params])
            freq = col([p.frequency_penalty for p in params])
            pres = col([p.presence_penalty for p in params])
            counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
            prompt_mask = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
            for i, s in enumerate(seqs):
                if s.output_token_ids:
                    ids = torch.tensor(s.output_token_ids, dtype=torch.int64, device=device)
                    counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
                if s.params.repetition_penalty != 1.0:
                    prompt_ids = torch.tensor(s.prompt_token_ids, dtype=torch.int64, device=device)
                    prompt_mask[i, prompt_ids] = True

        bias_rows, bias_tokens, bias_values = _sparse(
            [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()],
            device,
        )
        blocked = [
            (i, t, 0.0)
            for i, s in enumerate(seqs)
            if len(s.output_token_ids) < s.params.min_tokens
            for t in s.min_tokens_blocked_ids
        ]
        blocked_rows, blocked_tokens, _ = _sparse(blocked, device)
        max_num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        return cls(
            num_rows=n,
            all_greedy=all_greedy,
            temperature=temperature,
            is_greedy=is_greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            output_counts=counts,
            prompt_mask=prompt_mask,
            bias_rows=bias_rows,
            bias_tokens=bias_tokens,
            bias_values=bias_values,
            blocked_rows=blocked_rows,
            blocked_tokens=blocked_tokens,
            max_num_logprobs=max_num_logprobs,
        )


def _sparse(
    entries: list[tuple[int, int, float]], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    if not entries:
        return None, None, None
    rows, tokens, values = zip(*entries, strict=True)
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(tokens, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )
