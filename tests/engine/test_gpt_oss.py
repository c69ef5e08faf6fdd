"""gpt-oss beyond what every family is tested for (test_model_correctness
runs the tiny model against transformers in every scheduling regime):
OpenAI's MXFP4 expert checkpoints, and what it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrox import LLM, SamplingParams
from ferrox.common.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.layers.attention.torch_backend import TorchAttentionBackend
from ferrox.layers.quant_linear import QuantLinear, dequantize
from ferrox.models.gpt_oss import mxfp4_to_float, mxfp4_to_q8_0
from tests import models

MAX_TOKENS = 6
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, K] float -> MXFP4 blocks [..., rows, K / 32, 16] and
    exponents [..., rows, K / 32], as OpenAI's checkpoints store them: the
    smallest power-of-two scale under which the block's largest value is at
    most 6, each value rounded to the nearest e2m1."""
    blocks = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6)).clamp(-126, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # [..., G, 32] in 0..7
    codes = magnitude + 8 * (scaled < 0) * (magnitude > 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def mxfp4_checkpoints(source: Path, root: Path) -> tuple[Path, Path]:
    """The tiny model with its experts in MXFP4 (as OpenAI ships gpt-oss),
    and the same weights dequantized, in float, for transformers."""
    mxfp4, dense = root / "mxfp4", root / "dense"
    for d in (mxfp4, dense):
        shutil.copytree(source, d)
    state = load_file(source / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = to_mxfp4(tensor.transpose(1, 2))  # [E, out, in]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            state[name] = mxfp4_to_float(blocks, scales).transpose(1, 2).contiguous()
        else:
            packed[name] = tensor
    save_file(packed, mxfp4 / "model.safetensors")
    save_file(state, dense / "model.safetensors")
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    return mxfp4, dense


def run(path: Path, prompts: list[list[int]], **options) -> tuple[LLM, list]:
    llm = LLM(str(path), num_kv_blocks=64, max_num_seqs=4, kv_cache_dtype="float32", **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_used_blocks == 0
    return llm, [
        (
            o.outputs[0].token_ids,
            [
                lp[t].logprob
                for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        )
        for o in outs
    ]


def hf_greedy(path: Path, prompts: list[list[int]], round_expert_inputs: bool) -> list:
    """transformers on the dequantized weights; with `round_expert_inputs`,
    each expert projection's input rounded as the block kernel rounds it."""
    hf = models.hf_model(path)
    if round_expert_inputs:
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            gate = experts._apply_gate
            experts._apply_gate = lambda x, gate=gate: models.round_like_the_block_kernel(gate(x))
            experts.register_forward_pre_hook(
                lambda _, args: (models.round_like_the_block_kernel(args[0]), *args[1:])
            )
    return [models.hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_mxfp4_decodes_as_transformers_does() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(115, 135, (2, 6, 3), dtype=torch.uint8, generator=gen)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(mxfp4_to_float(blocks, scales).transpose(1, 2), reference)


def test_q8_0_rows_hold_the_mxfp4_values_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(3, 5, 64, generator=gen) * torch.logspace(-3, 2, 5)[None, :, None]
    blocks, scales = to_mxfp4(weight)
    exact = mxfp4_to_float(blocks, scales)
    rows = mxfp4_to_q8_0(blocks, scales)
    assert rows.shape == (3, 5, 2 * 34)
    got = torch.stack([dequantize(rows[e], "q8_0", 64) for e in range(3)])
    assert torch.equal(got, exact)
    # (an e2m1 rounding: at most a step of 2 at scale 2^ceil(log2(max / 6)) <= max / 3)
    blocks = weight.reshape(3, 5, 2, 32)
    error = (exact.reshape(blocks.shape) - blocks).abs().amax(-1)
    assert (error <= blocks.abs().amax(-1) / 3).all()


def test_mxfp4_experts_run_as_blocks_and_track_transformers(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    mxfp4, dense = mxfp4_checkpoints(tiny_models["gpt-oss"], tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, models.VOCAB_SIZE, (n,), generator=gen).tolist() for n in (5, 17)]
    llm, blocks = run(mxfp4, prompts)
    expert = llm.engine.runner.model.layers[0].mlp.experts[0]
    assert isinstance(expert.gate_up_proj, QuantLinear) and expert.gate_up_proj.fmt == "q8_0"
    assert isinstance(expert.down_proj, QuantLinear)
    assert not isinstance(llm.engine.runner.model.layers[0].self_attn.qkv_proj, QuantLinear)
    expected = hf_greedy(dense, prompts, round_expert_inputs=True)
    for (tokens, logprobs), (want, want_lp) in zip(blocks, expected, strict=True):
        assert tokens == want
        assert logprobs == pytest.approx(want_lp, abs=0.03)
    # Dequantized at load: transformers' own numbers.
    llm, floats = run(mxfp4, prompts, quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
    expected = hf_greedy(dense, prompts, round_expert_inputs=False)
    for (tokens, logprobs), (want, want_lp) in zip(floats, expected, strict=True):
        assert tokens == want
        assert logprobs == pytest.approx(want_lp, abs=1e-3)


def test_gpt_oss_refuses_what_it_cannot_run(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss: LLM.chat in the harmony format (the server's chat APIs read
    its channels: tests/server/test_harmony.py), other quantization methods,
    and a backend without sinks are refused by name; completions run."""
    from transformers import AutoTokenizer

    harmony = tmp_path / "harmony"
    shutil.copytree(tiny_models["gpt-oss"], harmony)
    tokenizer = AutoTokenizer.from_pretrained(harmony)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>"]})
    tokenizer.save_pretrained(harmony)
    llm = LLM(str(harmony), num_kv_blocks=64)
    with pytest.raises(InvalidArgumentError, match="harmony format"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
    assert (
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    )

    mxfp4 = tmp_path / "mxfp4"
    shutil.copytree(tiny_models["gpt-oss"], mxfp4)
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quantization 'awq'"):
        LLM(str(mxfp4), num_kv_blocks=64)

    monkeypatch.setattr(TorchAttentionBackend, "supports_sinks", False)
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        LLM(str(tiny_models["gpt-oss"]), num_kv_blocks=64, attention_backend="torch")


@pytest.mark.parametrize("expert_type", ["F32", "MXFP4"])
def test_a_gguf_in_llama_cpp_layout_matches_transformers(tmp_path: Path, expert_type: str) -> None:
    """gpt-oss as llama.cpp's converter writes it (sinks as `attn_sinks`,
    gate and up split, YaRN in `rope.scaling.*`), its experts in float or in
    MXFP4 (kept as Q8_0 blocks, exactly): transformers' tokens on the same
    weights (with the MXFP4 file, the experts' dequantized values and their
    inputs rounded as the block kernel rounds them)."""
    from gguf import GGMLQuantizationType as Q

    from ferrox.loader.gguf import load_gguf
    from tests.gguf_files import write_gpt_oss_gguf

    # (the SwiGLU clamp llama.cpp's graph fixes, as the file records none)
    source = models.build_tiny_model(tmp_path / "hf", "gpt-oss", vocab_size=258, swiglu_limit=7.0)
    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(path, source, getattr(Q, expert_type))
    loaded = load_gguf(path)
    assert loaded.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert loaded.config.rope_parameters["rope_type"] == "yarn"
    reference = source
    if expert_type == "MXFP4":
        # transformers on the experts as the file holds them
        reference = tmp_path / "dequantized"
        shutil.copytree(source, reference)
        state = load_file(source / "model.safetensors")
        for layer in range(loaded.config.num_hidden_layers):
            prefix = f"model.layers.{layer}.mlp.experts"
            gate_up, down = [], []
            for e in range(loaded.config.num_local_experts):
                gate, up, down_e = (
                    loaded.state_dict[f"{prefix}.{e}.{p}_proj.weight"]
                    for p in ("gate", "up", "down")
                )
                interleaved = torch.stack((gate, up), dim=1).flatten(0, 1)
                gate_up.append(interleaved.t())
                down.append(down_e.t())
            state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up).contiguous()
            state[f"{prefix}.down_proj"] = torch.stack(down).contiguous()
        save_file(state, reference / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 258, (n,), generator=gen).tolist() for n in (5, 17)]
    llm, got = run(path, prompts)
    expert = llm.engine.runner.model.layers[0].mlp.experts[0]
    assert isinstance(expert.gate_up_proj, QuantLinear) == (expert_type == "MXFP4")
    expected = hf_greedy(reference, prompts, round_expert_inputs=expert_type == "MXFP4")
    for (tokens, logprobs), (want, want_lp) in zip(got, expected, strict=True):
        assert tokens == want
        assert logprobs == pytest.approx(want_lp, abs=1e-3 if expert_type == "F32" else 0.03)
