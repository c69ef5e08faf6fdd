"""`kv_cache_dtype="float16"`: a float32 model's KV cache in half the
memory, read by the CPU attention kernels (and the torch backend) as
float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferrox import LLM, SamplingParams
from ferrox.common.config import EngineConfig
from ferrox.common.errors import InvalidArgumentError
from tests import models

MAX_TOKENS = 8


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()
    return [
        (
            list(o.outputs[0].token_ids),
            [
                lp[t].logprob
                for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        )
        for o in outputs
    ]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen3"])
def test_a_float16_cache_stays_close_to_float32(
    tiny_models: dict[str, Path], name: str, backend: str
) -> None:
    """Rounding K and V to float16 moves the logprobs by far less than the
    gaps greedy decoding chooses between; a shared prefix is read back from
    the cache by the second prompt's prefill."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(2, models.VOCAB_SIZE, (40,), generator=gen).tolist()
    prompts = [[*shared, 5, 6], [*shared, 7], [9, 10, 11]]
    path = str(tiny_models[name])
    runs = {}
    for dtype in ("auto", "float16"):
        llm = LLM(
            path, num_kv_blocks=64, max_num_seqs=4, attention_backend=backend, kv_cache_dtype=dtype
        )
        assert llm.engine.runner.kv_cache.dtype == (
            torch.float16 if dtype == "float16" else torch.float32
        )
        _greedy(llm, prompts[:1])  # the shared prefix is cached from here on
        runs[dtype] = _greedy(llm, prompts)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(
        runs["float16"], runs["auto"], strict=True
    ):
        agree = next(
            (i for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=True)) if a != b),
            MAX_TOKENS,
        )
        assert agree >= 4, (tokens, want_tokens)
        assert logprobs[:agree] == pytest.approx(want_logprobs[:agree], abs=2e-2)


def test_a_float16_cache_holds_twice_the_blocks(tiny_models: dict[str, Path]) -> None:
    path = str(tiny_models["llama-gqa-tied"])
    budget = 8 << 20
    full = LLM(path, kv_cache_memory_bytes=budget).engine.runner
    half = LLM(path, kv_cache_memory_bytes=budget, kv_cache_dtype="float16").engine.runner
    assert half.num_kv_blocks == 2 * full.num_kv_blocks
    assert half.kv_cache.num_bytes == full.kv_cache.num_bytes


def test_auto_is_float16_under_block_weights_on_the_cpu(tiny_models: dict[str, Path]) -> None:
    path = str(tiny_models["llama-gqa-tied"])

    def kv_dtype(**options: object) -> torch.dtype:
        return LLM(path, num_kv_blocks=16, **options).engine.runner.kv_cache.dtype

    assert kv_dtype() == torch.float32  # float weights: the model's dtype
    assert kv_dtype(quantization="q8_0") == torch.float16
    assert kv_dtype(quantization="q8_0", kv_cache_dtype="float32") == torch.float32


def test_kv_cache_dtypes_are_checked(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype must be one of"):
        EngineConfig.create(model="x", kv_cache_dtype="fp8")
    # A float16 model's cache is float16 already: "float16" is "auto" there.
    llm = LLM(
        str(tiny_models["llama-gqa-tied"]),
        num_kv_blocks=16,
        dtype="float16",
        kv_cache_dtype="float16",
    )
    assert llm.engine.runner.kv_cache.dtype == torch.float16
