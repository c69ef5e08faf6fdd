"""Whole-model checks on an NVIDIA GPU (skipped without one): greedy tokens
against transformers in float32 and bfloat16 with the Triton backend,
CUDA-graph replay against eager execution, and structured outputs' masks.

Engines here get a fixed, small KV pool (not one sized from free memory) and
GPU memory is released after every test, so that one failing test cannot
leave the next without memory and hide the first error."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrox import LLM, SamplingParams
from tests import models

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

MAX_TOKENS = 12
KV_BLOCKS = 1024  # of 16 tokens: room for every test's batch


@pytest.fixture(autouse=True)
def release_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def engine(path: Path | str, **options: Any) -> LLM:
    options.setdefault("num_kv_blocks", KV_BLOCKS)
    return LLM(str(path), device="cuda", **options)


def batch(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (3, 9, 17, 33, 60, 5, 21, 48)
    ]


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )


# (the GPU backends do not read sliding windows: a model whose window lies
# inside the test prompts is capped there, see test_model_correctness; nor
# do they have attention sinks, which gpt-oss needs)
@pytest.mark.parametrize(
    "name", [n for n in models.TINY_SPECS if "window" not in n and n != "gpt-oss"]
)
def test_tiny_models_fp32_match_transformers(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    hf = models.hf_model(path)
    prompts = batch(models.VOCAB_SIZE)
    llm = engine(path, dtype="float32", attention_backend="triton", max_num_seqs=8)
    outs = llm.generate(prompts, greedy(logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = models.hf_greedy(hf, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-3)


def test_smollm2_fp32_and_bf16(smollm2_path: Path) -> None:
    from transformers import LlamaForCausalLM as HfLlama

    from ferrox.loader.gguf import load_gguf

    gguf = load_gguf(smollm2_path)
    hf = HfLlama(gguf.config).eval()
    hf.load_state_dict(gguf.state_dict, strict=False)
    hf.tie_weights()
    prompts = [
        gguf.tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):", "1, 2, 3,")
    ]
    expected = [models.hf_greedy(hf, p, MAX_TOKENS)[0] for p in prompts]
    fp32 = engine(smollm2_path, dtype="float32")
    assert [
        o.outputs[0].token_ids for o in fp32.generate(prompts, greedy(), use_tqdm=False)
    ] == expected
    del fp32
    gc.collect()
    torch.cuda.empty_cache()
    # bfloat16 rounds differently from float32: require the first tokens to agree
    # and most of the rest.
    bf16 = engine(smollm2_path, dtype="bfloat16")
    got = [o.outputs[0].token_ids for o in bf16.generate(prompts, greedy(), use_tqdm=False)]
    for g, e in zip(got, expected, strict=True):
        assert g[:3] == e[:3]
        assert sum(a == b for a, b in zip(g, e, strict=True)) >= MAX_TOKENS // 2


def test_smollm2_gguf_blocks_through_the_triton_kernel(smollm2_path: Path) -> None:
    """quantization="gguf": the 4- and 8-bit blocks stay in GPU memory and every
    linear layer runs the Triton dequantize-GEMM (in CUDA graphs). In float32
    its output is the dequantized model's; bfloat16 rounds, as above."""
    from ferrox.layers.quant_linear import QuantLinear
    from ferrox.loader.gguf import load_gguf
    from ferrox.triton_kernels.quant_matmul import SplitBlocks

    tokenizer = load_gguf(smollm2_path).tokenizer
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):")]
    runs = {}
    for quantization in ("none", "gguf"):
        llm = engine(smollm2_path, dtype="float32", quantization=quantization)
        blocks = [m for m in llm.engine.loaded.model.modules() if isinstance(m, QuantLinear)]
        assert bool(blocks) == (quantization == "gguf")
        assert all(isinstance(m._split, SplitBlocks) for m in blocks)
        runs[quantization] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)
        ]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert runs["gguf"] == runs["none"]
    bf16 = engine(smollm2_path, dtype="bfloat16", quantization="gguf")
    got = [o.outputs[0].token_ids for o in bf16.generate(prompts, greedy(), use_tqdm=False)]
    for g, e in zip(got, runs["none"], strict=True):
        assert g[:3] == e[:3]


def test_quantize_at_load_on_gpu(tiny_models: dict[str, Path]) -> None:
    """quantization="q8_0" / "q4_1" of a float checkpoint on the GPU: the
    greedy tokens and logprobs of transformers with every linear weight
    rounded the same way (the Triton kernel keeps the activations in float32)."""
    path = tiny_models["llama-gqa-tied"]
    prompts = batch(models.VOCAB_SIZE)[:4]
    for fmt in ("q8_0", "q4_1"):
        gpu = engine(path, dtype="float32", quantization=fmt)
        outs = gpu.generate(prompts, greedy(logprobs=1), use_tqdm=False)
        del gpu
        gc.collect()
        torch.cuda.empty_cache()
        hf = models.hf_model_with_rounded_weights(path, fmt)
        for prompt, out in zip(prompts, outs, strict=True):
            tokens, logprobs = models.hf_greedy(hf, prompt, MAX_TOKENS)
            assert out.outputs[0].token_ids == tokens
            got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
            assert got == pytest.approx(logprobs, abs=1e-3)


def test_cuda_graphs_replay_matches_eager(tiny_models: dict[str, Path]) -> None:
    path = str(tiny_models["llama-gqa-tied"])
    prompts = (
        batch(models.VOCAB_SIZE) * 3
    )  # 24 requests: buckets 1..24 are exercised as they finish
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    runs = {}
    for eager in (True, False):
        llm = engine(path, dtype="float32", enforce_eager=eager, max_num_seqs=32)
        assert (llm.engine.runner.graphs is None) == eager
        runs[eager] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        stats = llm.engine.stats()
        assert stats.num_used_blocks == 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert runs[False] == runs[True]


def test_kv_pool_is_sized_from_gpu_memory(tiny_models: dict[str, Path]) -> None:
    # The one engine sized from free memory: the earlier tests' engines are gone.
    llm = LLM(str(tiny_models["qwen3"]), device="cuda", gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    _, total = torch.cuda.mem_get_info()
    assert runner.kv_cache.num_bytes < 0.5 * total
    assert runner.num_kv_blocks > 1000


def test_structured_outputs_match_the_cpu(tiny_models: dict[str, Path]) -> None:
    """Grammar masks applied on the GPU (the torch path, after a CUDA-graph
    decode): every output matches its regex, with the CPU engine's tokens."""
    import re

    from ferrox import StructuredOutputsParams

    path = tiny_models["llama-gqa-tied"]
    pattern = "[a-z]{5,12}( [a-z]{2,6}){1,3}"
    params = SamplingParams(
        temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    prompts = batch(models.VOCAB_SIZE)
    gpu = engine(path, dtype="float32", max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    cpu = LLM(str(path), dtype="float32", max_num_seqs=8, num_kv_blocks=256).generate(
        prompts, params, use_tqdm=False
    )
    for on_gpu, on_cpu in zip(gpu, cpu, strict=True):
        assert re.fullmatch(pattern, on_gpu.outputs[0].text)
        assert on_gpu.outputs[0].token_ids == on_cpu.outputs[0].token_ids


def test_speculative_decoding_matches_plain_decoding(tiny_models: dict[str, Path]) -> None:
    """Verification chunks of k + 1 positions run eagerly beside CUDA-graph
    decodes: n-gram and draft-model speculation give plain decoding's
    tokens (greedy and seeded), and a draft with the target's weights is
    always accepted (its KV cache shares the target's blocks)."""
    path = tiny_models["llama-gqa-tied"]
    prompts = [[5, 6, 7, 8] * 6 + [5, 6], *batch(models.VOCAB_SIZE)[:3]]
    params = [
        greedy(),
        SamplingParams(temperature=0.3, seed=1, max_tokens=32, ignore_eos=True),
    ]
    plain = engine(path, dtype="float32", max_num_seqs=8).generate(
        prompts * 2, params * 4, use_tqdm=False
    )
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3},
    ):
        llm = engine(path, dtype="float32", max_num_seqs=8, speculative_config=spec)
        out = llm.generate(prompts * 2, params * 4, use_tqdm=False)
        for a, b in zip(plain, out, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        stats = llm.engine.stats()
        assert stats.spec_num_accepted_tokens > 0
        if spec["method"] == "draft_model":
            assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens


def test_lora_adapters_match_peft_merged(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The stacked adapters and the Triton LoRA kernels, in float32, two
    adapters and the base in one batch, with CUDA graphs on for base steps."""
    from ferrox import LoRARequest

    base = tiny_models["qwen3"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    everything = models.build_lora_adapter(base, tmp_path / "all", rank=8, targets=targets)
    qv = models.build_lora_adapter(base, tmp_path / "qv", rank=4, targets=["q_proj", "v_proj"])
    llm = engine(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = batch(models.VOCAB_SIZE)[:4]
    loras = [LoRARequest("all", 1, str(everything)), LoRARequest("qv", 2, str(qv)), None]
    runs = [(p, lora) for p in prompts for lora in loras]
    outs = llm.generate(
        [p for p, _ in runs], greedy(), use_tqdm=False, lora_request=[x for _, x in runs]
    )
    oracles = {
        "all": models.hf_merged(base, everything),
        "qv": models.hf_merged(base, qv),
        None: models.hf_model(base),
    }
    for (prompt, lora), out in zip(runs, outs, strict=True):
        hf = oracles[lora.lora_name if lora else None]
        assert out.outputs[0].token_ids == models.hf_greedy(hf, prompt, MAX_TOKENS)[0]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_vision_language_fp32_matches_transformers(tmp_path: Path, family: str) -> None:
    """Images on the GPU: the vision tower, M-RoPE steps eager, decode steps
    in CUDA graphs (their positions shifted by the image's delta)."""
    from transformers import AutoModelForImageTextToText

    from tests.engine.test_images import CASES, assert_matches, hf_greedy_vl, request
    from tests.engine.test_images import greedy as image_greedy

    path = models.build_tiny_vl_model(tmp_path / family, family=family)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy_vl(hf, path, text, images) for text, images in CASES]
    llm = engine(path, dtype="float32", attention_backend="triton", max_model_len=256)
    outputs = llm.generate([request(t, i) for t, i in CASES], image_greedy(), use_tqdm=False)
    assert_matches(outputs, expected)


def test_gemma3_images_on_the_torch_backend_match_transformers(tmp_path: Path) -> None:
    """Gemma 3's bidirectional image tokens on the GPU: the torch attention
    backend (the Triton one refuses images for this family), chunked so
    that each image waits for a chunk of its own."""
    from tests.engine.test_gemma3_images import CASES, assert_matches, hf_greedy, request
    from tests.engine.test_gemma3_images import greedy as image_greedy

    path = models.build_tiny_gemma3_vl(tmp_path / "gemma3-vl")
    expected = [hf_greedy(path, text, images) for text, images in CASES]
    llm = engine(
        path,
        dtype="float32",
        attention_backend="torch",
        max_model_len=256,
        max_num_batched_tokens=20,
        max_num_seqs=4,
        block_size=4,
    )
    outputs = llm.generate([request(t, i) for t, i in CASES], image_greedy(), use_tqdm=False)
    assert_matches(outputs, expected)
