"""ferrox against transformers on the same weights: greedy tokens equal and
logprobs close, for tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE / SmolLM3 /
Phi-3 / Gemma 3 models and the bundled SmolLM2, in one batch, with prefix
caching, under preemption and with chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferrox import LLM, SamplingParams
from ferrox.common.errors import InvalidArgumentError
from ferrox.layers.attention.torch_backend import TorchAttentionBackend
from tests import models

MAX_TOKENS = 10
# Eight prompts of different lengths; two share a long prefix.
PROMPT_LENGTHS = [3, 7, 12, 17, 24, 31, 40, 53]


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randint(2, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    out[-1] = out[-2][:36] + out[-1][:17]  # shares 36 tokens with the previous prompt
    return out


def greedy(max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )


def assert_matches_hf(outputs, hf, batch: list[list[int]], check_logprobs: bool) -> None:
    for prompt, out in zip(batch, outputs, strict=True):
        expected, expected_lp = models.hf_greedy(hf, prompt, MAX_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens"
        if check_logprobs:
            got = [lp[t].logprob for lp, t in zip(completion.logprobs, expected, strict=True)]
            assert got == pytest.approx(expected_lp, abs=1e-3)


@pytest.mark.parametrize("name", list(models.TINY_SPECS))
def test_tiny_models_match_transformers(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    hf = models.hf_model(path)
    batch = prompts(models.VOCAB_SIZE)
    llm = LLM(str(path), max_num_seqs=8, num_kv_blocks=256)
    outputs = llm.generate(batch, greedy(logprobs=2), use_tqdm=False)
    assert_matches_hf(outputs, hf, batch, check_logprobs=True)
    # Prompt tokens in the top-k entries are consistent: the sampled token is
    # rank 1 under greedy decoding.
    assert all(
        lp[t].rank == 1
        for lp, t in zip(
            outputs[0].outputs[0].logprobs, outputs[0].outputs[0].token_ids, strict=True
        )
    )
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    ("label", "options"),
    [
        ("prefix-cache", dict(enable_prefix_caching=True, block_size=4)),
        ("no-prefix-cache", dict(enable_prefix_caching=False)),
        ("preemption", dict(num_kv_blocks=12, block_size=8, max_model_len=96)),
        ("chunked-prefill", dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4)),
    ],
)
@pytest.mark.parametrize(
    "name",
    ["llama-gqa-tied", "qwen3-moe", "gemma3-window", "mistral-window", "gpt-oss", "granite"],
)
def test_scheduling_regimes_match_transformers(
    tiny_models: dict[str, Path], label: str, options: dict, name: str
) -> None:
    path = tiny_models[name]
    hf = models.hf_model(path)
    batch = prompts(models.VOCAB_SIZE, seed=1)
    if name == "mistral-window" and label == "preemption":
        # No full-attention memory: only a window pool smaller than the
        # batch's windows preempts (num_kv_blocks sizes it).
        options = dict(options, num_kv_blocks=7, max_num_batched_tokens=16)
    llm = LLM(str(path), **{"num_kv_blocks": 256, "max_num_seqs": 8, **options})
    outputs = llm.generate(batch, greedy(), use_tqdm=False)
    assert_matches_hf(outputs, hf, batch, check_logprobs=False)
    stats = llm.engine.stats()
    if label == "prefix-cache":
        # Run again: the prompts now come from the cache.
        again = llm.generate(batch, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
        assert llm.engine.stats().prefix_hit_tokens > sum(PROMPT_LENGTHS) // 2
        assert sum(o.metrics.num_cached_tokens for o in again) > 0
    if label == "preemption":
        assert stats.num_preemptions > 0
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_cached_tokens_are_reported_when_one_token_is_left_to_compute(
    tiny_models: dict[str, Path],
) -> None:
    """A prompt seen again: the cache serves every token but the last, so
    its prefill is a single token (a row the step plans with the decodes);
    its metrics still count the hit, and say when it was first scheduled.
    One token longer than a whole number of blocks, the blocks serve it; two
    longer, the block the first run filled with its last prompt token and
    its outputs serves one more position (its KV copied)."""
    llm = LLM(str(tiny_models["llama-gqa-tied"]), num_kv_blocks=64, block_size=4)
    for length in (9, 10):
        prompt = {"prompt_token_ids": list(range(length, 2 * length))}
        first, again = (llm.generate([prompt], greedy(), use_tqdm=False)[0] for _ in range(2))
        assert first.metrics is not None and again.metrics is not None
        cached = (first.metrics.num_cached_tokens, again.metrics.num_cached_tokens)
        assert cached == (0, length - 1)
        assert again.metrics.first_scheduled_time is not None
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.stats().num_used_blocks == 0


def test_a_fan_out_computes_its_shared_prefix_once(tiny_models: dict[str, Path]) -> None:
    """Six requests that share 48 prompt tokens arrive together: one computes
    them, the others wait a step and find them in the prefix cache; every
    output is what transformers gives for its prompt alone."""
    path = tiny_models["llama-gqa-tied"]
    hf = models.hf_model(path)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, models.VOCAB_SIZE, (48,), generator=gen).tolist()
    batch = [[*prefix, 10 + i, 20 + i] for i in range(6)]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_num_seqs=8)
    outputs = llm.generate(batch, greedy(), use_tqdm=False)
    assert_matches_hf(outputs, hf, batch, check_logprobs=False)
    assert llm.engine.stats().prefix_hit_tokens == 5 * 48
    assert [o.metrics.num_cached_tokens for o in outputs] == [0] + [48] * 5
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_a_backend_without_windows_caps_the_context(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3's local layers see 128 positions. The CPU backends implement
    windows, so the context is the model's; under a backend that does not,
    the context stays inside the window (where local and global attention
    agree), and a longer one is refused naming it."""
    path = str(tiny_models["gemma3"])
    assert LLM(path, num_kv_blocks=64).engine.max_model_len == 256
    monkeypatch.setattr(TorchAttentionBackend, "supports_sliding_window", False)
    capped = LLM(path, num_kv_blocks=64, attention_backend="torch")
    assert capped.engine.max_model_len == 128
    assert capped.engine.runner.num_window_blocks == 0  # every layer full attention
    with pytest.raises(InvalidArgumentError, match="sliding window of 128 tokens"):
        LLM(path, max_model_len=200, attention_backend="torch")


@pytest.mark.parametrize("name", ["gemma3-window", "mistral-window"])
def test_a_long_request_holds_only_its_window(tiny_models: dict[str, Path], name: str) -> None:
    """A 200-token sequence under a window of 6-8 positions: its window pool
    blocks stay a few however long it grows (the full-attention layers' grow
    with it), and its tokens are transformers'."""
    path = tiny_models[name]
    hf = models.hf_model(path)
    prompt = torch.randint(2, models.VOCAB_SIZE, (150,), generator=torch.Generator().manual_seed(3))
    batch = [prompt.tolist()]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("long", batch[0], greedy(max_tokens=50))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        info = engine.scheduler.request_info(0)
        if info is not None and info["status"] == "running":
            held.append(
                (info["num_computed_tokens"], info["num_blocks"], info["num_window_blocks"])
            )
    window = engine.runner.sliding_window
    assert window is not None
    computed, blocks, window_blocks = held[-1]
    assert computed > 190 and blocks == -(-(computed + 1) // 4)
    # The window behind the next position, and the step's chunk (32 tokens).
    assert max(w for _, _, w in held) <= -(-(window - 1) // 4) + 2 + 32 // 4
    assert window_blocks <= -(-(window - 1) // 4) + 2
    expected, _ = models.hf_greedy(hf, batch[0], 50)
    out = llm.generate(batch, greedy(max_tokens=50), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
    assert engine.stats().num_used_blocks == 0
    engine.scheduler.check_integrity()


def test_longrope_picks_its_factors_by_the_context_length(tmp_path: Path) -> None:
    """Pretrained on 16 positions: an engine whose context fits them uses
    the short factors, a longer one the long factors and the attention
    factor (transformers switches by the forward's longest position, so the
    prompts of each case stay on one side of 16)."""
    _, spec = models.TINY_SPECS["phi3-longrope"]
    rope = dict(spec["rope_scaling"], original_max_position_embeddings=16)
    path = models.build_tiny_model(
        tmp_path / "phi3-long", "phi3-longrope", original_max_position_embeddings=16,
        rope_scaling=rope,
    )  # fmt: skip
    hf = models.hf_model(path)
    batch = [p for p in prompts(models.VOCAB_SIZE, seed=2) if len(p) > 16]
    long = LLM(str(path), max_num_seqs=8, num_kv_blocks=256).generate(
        batch, greedy(logprobs=1), use_tqdm=False
    )
    assert_matches_hf(long, hf, batch, check_logprobs=True)
    batch = [p[:6] for p in batch[:2]]  # 6 + MAX_TOKENS = 16 positions
    short = LLM(str(path), max_model_len=16, num_kv_blocks=64).generate(
        batch, greedy(logprobs=1), use_tqdm=False
    )
    assert_matches_hf(short, hf, batch, check_logprobs=True)


def test_smollm2_matches_transformers(smollm2_path: Path) -> None:
    from transformers import LlamaForCausalLM as HfLlama

    from ferrox.loader.gguf import load_gguf

    gguf = load_gguf(smollm2_path)
    hf = HfLlama(gguf.config).eval()
    hf.load_state_dict(gguf.state_dict, strict=False)
    hf.tie_weights()
    tokenizer = gguf.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "1, 2, 3, 4,",
        "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
        "Translate to French: good morning",
        "The three primary colors are",
        "import numpy as np\nx = np.",
    ]
    batch = [tokenizer.encode(t) for t in texts]
    # Dequantized to float32: the dense path matches transformers token for
    # token (the default keeps the blocks: tests/kernels/test_quantized_weights.py).
    llm = LLM(str(smollm2_path), max_num_seqs=8, quantization="none")
    outputs = llm.generate(batch, greedy(logprobs=1), use_tqdm=False)
    assert_matches_hf(outputs, hf, batch, check_logprobs=True)
    assert outputs[0].outputs[0].text == tokenizer.decode(outputs[0].outputs[0].token_ids)
