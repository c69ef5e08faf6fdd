"""LoRA adapters against transformers + peft with the adapter merged: greedy
tokens equal and logprobs close for each adapter in one batch with the base
model and the other adapters, under prefix caching, chunked prefill and
preemption, over float and block-format base weights; the prefix cache never
shares KV across adapters; bad adapters are refused with nothing leaked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ferrox import LLM, LoRARequest, SamplingParams
from ferrox.common.errors import InvalidArgumentError, LoRAAdapterError, UnsupportedModelError
from tests import models
from tests.engine.test_model_correctness import MAX_TOKENS, assert_matches_hf, greedy, prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = ["llama-gqa-tied", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def adapters(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per family: two adapters (every module at rank 8; q/v at rank 4 with
    rsLoRA)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name in FAMILIES:
        base = tiny_models[name]
        out[name] = (
            models.build_lora_adapter(base, root / f"{name}-all", rank=8, targets=ALL, seed=1),
            models.build_lora_adapter(
                base,
                root / f"{name}-qv",
                rank=4,
                targets=["q_proj", "v_proj"],
                use_rslora=True,
                seed=2,
            ),
        )
    return out


def _check_idle(llm: LLM) -> None:
    """Every block back, every adapter's use given back."""
    engine = llm.engine
    assert engine.stats().num_used_blocks == 0
    engine.scheduler.check_integrity()
    assert engine.adapters is not None
    assert all(users == 0 for users in engine.adapters.num_users().values())


REGIMES = {
    "plain": dict(num_kv_blocks=256),
    "cached-4-token-blocks": dict(num_kv_blocks=256, block_size=4),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=16, max_num_seqs=4),
    "preempting": dict(num_kv_blocks=12, block_size=8, max_model_len=96, max_num_seqs=8),
}


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("name", FAMILIES)
def test_adapters_in_one_batch_match_peft_merged(
    tiny_models: dict[str, Path], adapters: dict, name: str, regime: str
) -> None:
    base = tiny_models[name]
    everything, qv = adapters[name]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **REGIMES[regime])
    batch = prompts(models.VOCAB_SIZE)
    lora_all = LoRARequest("all", 1, str(everything))
    lora_qv = LoRARequest("qv", 2, str(qv))
    # base, all, qv, base, all, ... : every prompt under every adapter
    which = [None, lora_all, lora_qv]
    runs = [(p, which[(i + k) % 3]) for i, p in enumerate(batch) for k in range(3)]
    outputs = llm.generate(
        [p for p, _ in runs],
        greedy(logprobs=1),
        use_tqdm=False,
        lora_request=[lora for _, lora in runs],
    )
    if regime == "preempting":
        assert llm.engine.stats().num_preemptions > 0
    oracles = {
        None: models.hf_model(base),
        "all": models.hf_merged(base, everything),
        "qv": models.hf_merged(base, qv),
    }
    for key, hf in oracles.items():
        mine = [
            (p, out)
            for (p, lora), out in zip(runs, outputs, strict=True)
            if (lora.lora_name if lora else None) == key
        ]
        assert_matches_hf([o for _, o in mine], hf, [p for p, _ in mine], check_logprobs=True)
    # The adapters change the tokens (else the comparison proves nothing).
    by_run = {
        (tuple(p), lora.lora_name if lora else None): o.outputs[0].token_ids
        for (p, lora), o in zip(runs, outputs, strict=True)
    }
    for p in batch:
        assert by_run[(tuple(p), "all")] != by_run[(tuple(p), None)]
        assert by_run[(tuple(p), "qv")] != by_run[(tuple(p), None)]
    _check_idle(llm)


def test_the_prefix_cache_never_shares_kv_across_adapters(
    tiny_models: dict[str, Path], adapters: dict
) -> None:
    base = tiny_models["llama-gqa-tied"]
    everything, qv = adapters["llama-gqa-tied"]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=256)
    prompt = prompts(models.VOCAB_SIZE)[-1]  # 53 tokens: three full blocks
    lora_all = LoRARequest("all", 1, str(everything))
    lora_qv = LoRARequest("qv", 2, str(qv))

    def run(lora: LoRARequest | None) -> tuple[list[int], int]:
        out = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=lora)[0]
        assert out.metrics is not None
        return out.outputs[0].token_ids, out.metrics.num_cached_tokens

    cold, _ = run(None)
    assert run(None)[1] == 48  # the base model hits its own blocks
    first, cached = run(lora_all)
    assert cached == 0, "an adapter reused the base model's KV"
    assert run(lora_qv)[1] == 0, "an adapter reused another adapter's KV"
    again, cached = run(lora_all)
    assert cached == 48  # its own blocks, from its first run
    expected, _ = models.hf_greedy(models.hf_merged(base, everything), prompt, MAX_TOKENS)
    assert again == first == expected != cold
    _check_idle(llm)


def test_one_adapter_at_a_time_still_serves_all(
    tiny_models: dict[str, Path], adapters: dict
) -> None:
    """max_loras=1: the scheduler runs one adapter's requests at a time (and
    base requests beside them); the idle adapter cache keeps one."""
    base = tiny_models["qwen3"]
    everything, qv = adapters["qwen3"]
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=256)
    batch = prompts(models.VOCAB_SIZE)[:4]
    loras = [LoRARequest("all", 1, str(everything)), LoRARequest("qv", 2, str(qv)), None]
    runs = [(p, lora) for p in batch for lora in loras]
    outputs = llm.generate(
        [p for p, _ in runs], greedy(), use_tqdm=False, lora_request=[x for _, x in runs]
    )
    for key, path in (("all", everything), ("qv", qv)):
        mine = [
            (p, o)
            for (p, lora), o in zip(runs, outputs, strict=True)
            if lora is not None and lora.lora_name == key
        ]
        hf = models.hf_merged(base, path)
        assert_matches_hf([o for _, o in mine], hf, [p for p, _ in mine], check_logprobs=False)
    assert len(llm.engine.runner.lora.loaded) == 1  # max_cpu_loras defaults to max_loras
    _check_idle(llm)


def _round_base_inputs(module: torch.nn.Module, args: tuple) -> tuple:
    (x,) = args
    return (models.round_like_the_block_kernel(x),)


def test_adapters_over_block_format_weights(tiny_models: dict[str, Path], adapters: dict) -> None:
    """The base weights in Q8_0 blocks (the integer kernels, and the fused
    decode for base-only steps) with float deltas: against transformers on
    the rounded weights, the base layers' inputs rounded as the kernel
    rounds them, the adapter unmerged and unrounded."""
    from peft import PeftModel

    base = tiny_models["llama-gqa-tied"]
    everything, _ = adapters["llama-gqa-tied"]
    llm = LLM(
        str(base),
        enable_lora=True,
        max_lora_rank=8,
        quantization="q8_0",
        kv_cache_dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=4,
    )
    assert llm.engine.runner.model.fused_decode is not None
    batch = prompts(models.VOCAB_SIZE)[:3]
    lora = LoRARequest("all", 1, str(everything))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outputs = llm.generate(batch * 2, params, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    hf = PeftModel.from_pretrained(models.hf_model_with_rounded_weights(base, "q8_0"), everything)
    hooks = [
        m.register_forward_pre_hook(_round_base_inputs)
        for n, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear) and "lora_" not in n
    ]
    try:
        for prompt, out in zip(batch, outputs[:3], strict=True):
            tokens, logprobs = models.hf_greedy(hf, prompt, 6)
            assert out.outputs[0].token_ids == tokens
            got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
            assert got == pytest.approx(logprobs, abs=0.03)  # (the kernels' rounding drift)
    finally:
        for hook in hooks:
            hook.remove()
    _check_idle(llm)


# ---- bad input -----------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> Path:
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
    return path


def test_bad_adapters_are_refused_and_nothing_leaks(
    tiny_models: dict[str, Path], adapters: dict, tmp_path: Path
) -> None:
    base = tiny_models["llama-gqa-tied"]
    good, small = adapters["llama-gqa-tied"]  # ranks 8 and 4
    other_base = tiny_models["llama-mha-untied"]  # hidden 80, not 96
    foreign = models.build_lora_adapter(other_base, tmp_path / "foreign", rank=4, targets=ALL)
    head = models.build_lora_adapter(base, tmp_path / "head", rank=4, targets=["lm_head"])
    no_weights = _copy(small, tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    truncated = _copy(small, tmp_path / "truncated")
    (truncated / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00")
    cases = {
        "is not a directory": tmp_path / "missing",
        "has no adapter_config.json": tmp_path,
        "exceeds max_lora_rank=4": good,  # rank 8
        "has no adapter_model.safetensors": no_weights,
        "not a safetensors file": truncated,
        "another base model": foreign,
        "targets no module ferrox adapts": head,
        "DoRA": _edit_config(_copy(small, tmp_path / "dora"), use_dora=True),
        "only adapters without biases": _edit_config(_copy(small, tmp_path / "bias"), bias="all"),
    }
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=4, num_kv_blocks=64)
    prompt = prompts(models.VOCAB_SIZE)[2]
    for i, (message, path) in enumerate(cases.items()):
        with pytest.raises(LoRAAdapterError, match=message):
            llm.generate(
                [prompt, prompt],
                greedy(),
                use_tqdm=False,
                lora_request=[None, LoRARequest(f"bad{i}", i + 1, str(path))],
            )
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.runner.lora.loaded == set()
        _check_idle(llm)
    # The engine goes on serving.
    out = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    assert (
        out.outputs[0].token_ids == models.hf_greedy(models.hf_model(base), prompt, MAX_TOKENS)[0]
    )
    with pytest.raises(LoRAAdapterError, match="positive"):
        LoRARequest("x", 0, str(good))


def test_an_id_names_one_adapter_and_in_use_adapters_stay(
    tiny_models: dict[str, Path], adapters: dict
) -> None:
    base = tiny_models["llama-gqa-tied"]
    everything, qv = adapters["llama-gqa-tied"]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    engine = llm.engine
    prompt = prompts(models.VOCAB_SIZE)[3]
    engine.add_request("a", prompt, greedy(), lora_request=LoRARequest("all", 1, str(everything)))
    with pytest.raises(LoRAAdapterError, match="give each adapter its own id"):
        engine.add_request("b", prompt, greedy(), lora_request=LoRARequest("qv", 1, str(qv)))
    assert engine.adapters is not None
    with pytest.raises(LoRAAdapterError, match="in use by 1 request"):
        engine.adapters.unload("all")
    engine.abort_request("a")
    assert engine.adapters.num_users() == {"all": 0}
    assert engine.adapters.unload("all")
    assert engine.runner.lora.loaded == set()
    _check_idle(llm)


def test_engines_that_cannot_serve_adapters_say_so(
    tiny_models: dict[str, Path], adapters: dict
) -> None:
    everything, _ = adapters["llama-gqa-tied"]
    base = tiny_models["llama-gqa-tied"]
    plain = LLM(str(base), num_kv_blocks=32)
    with pytest.raises(InvalidArgumentError, match="enable_lora=True"):
        plain.generate(
            [[5, 6, 7]],
            greedy(),
            use_tqdm=False,
            lora_request=LoRARequest("all", 1, str(everything)),
        )
    assert not plain.engine.has_unfinished_requests()
    with pytest.raises(InvalidArgumentError, match="speculative decoding"):
        LLM(
            str(base),
            enable_lora=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(InvalidArgumentError, match="max_lora_rank"):
        LLM(str(base), enable_lora=True, max_lora_rank=0)
    with pytest.raises(InvalidArgumentError, match="max_cpu_loras"):
        LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(UnsupportedModelError, match="do not run on Gemma3ForCausalLM"):
        LLM(str(tiny_models["gemma3"]), enable_lora=True, num_kv_blocks=32)


def test_adapters_under_tensor_parallelism(tmp_path: Path) -> None:
    """Two ranks over gloo, each with its shard of the base and of each
    adapter (B by rows in q/k/v and gate/up, A by columns in o and down):
    the same tokens as the merged model; the workers load an adapter as rank
    0 does, and drop it with it."""
    base = models.build_tiny_model(
        tmp_path / "qwen2", "qwen2", num_attention_heads=4, num_key_value_heads=2
    )
    everything = models.build_lora_adapter(base, tmp_path / "all", rank=8, targets=ALL, seed=1)
    qv = models.build_lora_adapter(
        base, tmp_path / "qv", rank=4, targets=["q_proj", "v_proj"], use_rslora=True, seed=2
    )
    llm = LLM(
        str(base), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
        max_cpu_loras=2, max_model_len=128,
    )  # fmt: skip
    batch = prompts(models.VOCAB_SIZE)[:4]
    loras = [LoRARequest("all", 1, str(everything)), LoRARequest("qv", 2, str(qv)), None]
    runs = [(p, lora) for p in batch for lora in loras]
    outputs = llm.generate(
        [p for p, _ in runs], greedy(logprobs=1), use_tqdm=False,
        lora_request=[x for _, x in runs],
    )  # fmt: skip
    for key, path in (("all", everything), ("qv", qv), (None, None)):
        mine = [(p, o) for (p, lora), o in zip(runs, outputs, strict=True)
                if (lora.lora_name if lora else None) == key]  # fmt: skip
        hf = models.hf_model(base) if path is None else models.hf_merged(base, path)
        assert_matches_hf([o for _, o in mine], hf, [p for p, _ in mine], check_logprobs=True)
    # A third adapter: the idle LRU (2) drops the oldest on every rank alike.
    third = LoRARequest("again", 3, str(everything))
    llm.generate(batch[:1], greedy(), use_tqdm=False, lora_request=third)
    assert len(llm.engine.runner.lora.loaded) == 2
    _check_idle(llm)
    llm.engine.close()
