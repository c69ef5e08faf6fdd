"""Tensor parallelism on the CPU (gloo, 2 ranks): the same greedy tokens and
logprobs as one rank on tiny Llama, Qwen2, Qwen3, Qwen3-MoE and Phi-3 models
(split and replicated KV heads, tied and untied and odd-sized vocabularies,
row-parallel biases, experts split by their intermediate columns), through
`LLM` and `ferrox serve`; bad sizes refused; no worker process outlives its
engine, and a lost worker stops the engine."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ferrox import LLM, SamplingParams
from ferrox.common.errors import EngineDeadError, InvalidArgumentError
from ferrox.parallel import state as distributed
from tests import models
from tests.live_server import HTTP, MODEL, Server, make_model_dir

PROMPTS = [[5, 9, 33, 40, 2, 7], [11, 12, 13], list(range(3, 60)), [300, 4]]


@pytest.fixture(scope="module")
def tp_models(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "llama, KV heads split": tiny_models["llama-gqa-tied"],
        "llama, one KV head replicated": tiny_models["llama3-rope-scaling"],
        "qwen3, q/k norms": tiny_models["qwen3"],
        "phi3, fused qkv and gate/up split per rank": tiny_models["phi3"],
        "qwen3-moe, every expert split per rank": tiny_models["qwen3-moe"],
        "gemma3, a window pool on each rank": tiny_models["gemma3-window"],
        "gpt-oss, sinks and interleaved experts split per rank": tiny_models["gpt-oss"],
        "qwen2-moe, the shared expert split per rank": tiny_models["qwen2-moe"],
        "qwen2, q/k/v biases": models.build_tiny_model(
            root / "qwen2", "qwen2", num_attention_heads=4, num_key_value_heads=2
        ),
        "llama, o/down biases, odd vocabulary": models.build_tiny_model(
            root / "llama-bias",
            "llama-mha-untied",
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_bias=True,
            mlp_bias=True,
            vocab_size=models.VOCAB_SIZE + 1,
        ),
    }


def _worker_processes() -> list[psutil.Process]:
    """The tensor-parallel workers this test process started (directly, or
    through a server it runs): not another test process's."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "ferrox.executor.worker" in proc.cmdline():
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture(autouse=True)
def no_worker_left() -> Iterator[None]:
    yield
    gc.collect()
    assert distributed.state().size == 1
    assert psutil.wait_procs(_worker_processes(), timeout=10)[1] == []


def _run(path: Path, tp: int) -> list[tuple[list[int], list[float], list[float]]]:
    llm = LLM(str(path), tensor_parallel_size=tp, max_model_len=128)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)] * (
            len(PROMPTS) - 1
        ) + [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.stats().num_used_blocks == 0
    finally:
        llm.engine.close()
    results = []
    for out in outs:
        seq = out.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(seq.logprobs or [], seq.token_ids, strict=False)]
        prompt = (
            [
                entry[t].logprob
                for entry, t in zip(out.prompt_logprobs, out.prompt_token_ids, strict=True)
                if entry is not None
            ]
            if out.prompt_logprobs is not None
            else []
        )
        results.append((seq.token_ids, logprobs, prompt))
    return results


@pytest.mark.parametrize(
    "name",
    [
        "llama, KV heads split",
        "llama, one KV head replicated",
        "qwen3, q/k norms",
        "phi3, fused qkv and gate/up split per rank",
        "qwen3-moe, every expert split per rank",
        "gemma3, a window pool on each rank",
        "gpt-oss, sinks and interleaved experts split per rank",
        "qwen2-moe, the shared expert split per rank",
        "qwen2, q/k/v biases",
        "llama, o/down biases, odd vocabulary",
    ],
)
def test_two_ranks_match_one(tp_models: dict[str, Path], name: str) -> None:
    one = _run(tp_models[name], 1)
    two = _run(tp_models[name], 2)
    for (tokens1, lp1, prompt1), (tokens2, lp2, prompt2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        assert lp2 == pytest.approx(lp1, abs=1e-4)
        assert prompt2 == pytest.approx(prompt1, abs=1e-4)
    assert one[-1][2]  # the prompt-logprob request got them


def test_sizes_the_model_cannot_split_are_refused(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgumentError, match="must divide the model's 3 attention heads"):
        LLM(str(tiny_models["qwen2"]), tensor_parallel_size=2)
    with pytest.raises(InvalidArgumentError, match="exceeds the"):  # before any worker starts
        LLM(str(tiny_models["qwen2"]), tensor_parallel_size=10**6)
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size must be"):
        LLM(str(tiny_models["qwen2"]), tensor_parallel_size=0)
    with pytest.raises(InvalidArgumentError, match="speculative decoding"):
        LLM(
            str(tiny_models["qwen2"]),
            tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(InvalidArgumentError, match="block-format weights"):
        LLM(str(tiny_models["qwen2"]), tensor_parallel_size=2, quantization="q8_0")


def test_a_lost_worker_stops_the_engine(tp_models: dict[str, Path]) -> None:
    llm = LLM(str(tp_models["llama, KV heads split"]), tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        (worker,) = llm.engine.executor.worker_processes()
        worker.kill()
        worker.wait()
        with pytest.raises(EngineDeadError, match="worker 1 exited"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
    finally:
        llm.engine.close()


def test_serve_with_two_ranks(
    tp_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`ferrox serve --tensor-parallel-size 2`: the engine process starts one
    worker, serves what one rank computes, and takes the worker down with it."""
    path = make_model_dir(tp_models["llama, KV heads split"], tmp_path_factory.mktemp("tp"))
    prompt = [5, 9, 33, 40, 2, 7]
    llm = LLM(str(path))
    expected = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    del llm
    server = Server(path, "--tensor-parallel-size", "2")
    workers = []
    try:
        workers = _worker_processes()
        assert len(workers) == 1
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        out = server.post("/v1/completions", {**body, "ignore_eos": True})
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["text"] == expected.text
        chat = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.usage is not None and chat.usage.completion_tokens > 0
        assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
    assert psutil.wait_procs(workers, timeout=10)[1] == []
