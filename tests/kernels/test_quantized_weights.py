"""Block-quantized weights on the CPU (q4_1 / q8_0): the layers against the
float matmul on the dequantized weight, GGUF blocks kept as stored against
the GGUF reference dequantization, and whole engines against their dense
twins (same weights, dequantized) and transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

from ferrox import LLM, SamplingParams
from ferrox._native import cpu_isa, gate_rows_cpu
from ferrox.common.config import EngineConfig
from ferrox.common.errors import InvalidArgumentError
from ferrox.layers import cpu_decoder, cpu_linear, quant_linear
from ferrox.layers.activation import gated_projection, gelu_tanh_and_mul, silu_and_mul
from ferrox.layers.moe import SparseMoe
from ferrox.layers.quant_linear import (
    QuantEmbedding,
    QuantLinear,
    dequantize,
    quantize,
    scale_blocks,
)
from ferrox.loader import model_loader
from ferrox.loader.gguf import load_gguf
from ferrox.loader.gguf_dequant import BlockTensor, q4_k_as_q4_1
from ferrox.loader.model_loader import block_plan
from ferrox.models.llama import LlamaForCausalLM
from tests import models
from tests.gguf_files import _gguf_name, _llama_cpp_permute, _random_model, _write_gguf

FORMATS = ["q4_1", "q8_0"]


def _activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far x @ w.T may move when each 32-wide block of x is rounded to
    int8 with scale max|x| / 127 (the kernel's activation quantization):
    |x - x~| <= scale / 2 per element, so per output at most
    sum over blocks of scale / 2 * sum |w| over the block."""
    rows, k = x.shape
    scale = x.reshape(rows, k // 32, 32).abs().amax(-1) / 127  # [rows, blocks]
    w_abs = w.abs().reshape(w.shape[0], k // 32, 32).sum(-1)  # [n, blocks]
    return (scale / 2) @ w_abs.T  # [rows, n]


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_error_is_within_half_a_step(fmt: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 256, generator=gen) * torch.rand(40, 1, generator=gen) * 3
    w[3] = 0.0  # an all-zero row has scale 0
    blocks = quantize(w, fmt)
    assert blocks.dtype == torch.uint8 and blocks.shape == (
        40,
        256 // 32 * {"q4_1": 20, "q8_0": 34}[fmt],
    )
    back = dequantize(blocks, fmt, 256)
    raw = blocks.numpy().reshape(40, 8, -1)
    step = torch.from_numpy(raw[..., :2].copy().view(np.float16).astype(np.float32))  # [40, 8, 1]
    err = (back - w).abs().reshape(40, 8, 32)
    # Half a step, plus the float16 rounding of the stored scale and offset.
    assert bool((err <= step / 2 + 2e-3 * w.abs().max()).all())
    assert torch.equal(back[3], torch.zeros(256))
    # Requantizing the dequantized weight reproduces it.
    assert torch.equal(dequantize(quantize(back, fmt), fmt, 256), back)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 10])
@pytest.mark.parametrize("dequantized", [False, True])
def test_quant_linear_matches_float_linear(
    fmt: str,
    rows: int,
    bias: bool,
    chunk_rows: int | None,
    dequantized: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both paths whatever this CPU's crossover: the integer kernel, or the
    # weight dequantized (10 rows at a time with chunk_rows: 47 = 4 x 10 + 7)
    # and a float GEMM.
    monkeypatch.setattr(quant_linear, "DEQUANTIZE_ABOVE_ROWS", 0 if dequantized else rows)
    if chunk_rows is not None:
        monkeypatch.setattr(quant_linear, "DEQUANTIZE_CHUNK_ELEMENTS", 160 * chunk_rows)
    gen = torch.Generator().manual_seed(rows)
    dense = torch.nn.Linear(160, 47, bias=bias)  # an odd number of outputs
    with torch.no_grad():
        dense.weight.copy_(torch.randn(47, 160, generator=gen))
        if bias:
            dense.bias.copy_(torch.randn(47, generator=gen))
    layer = QuantLinear.from_linear(dense, fmt)
    w = dequantize(layer.weight, fmt, 160)
    x = torch.randn(rows, 160, generator=gen)
    x[0, :32] = 0.0  # a block of zeros quantizes to scale 0
    expected = F.linear(x.double(), w.double(), None if layer.bias is None else layer.bias.double())
    got = layer(x.view(1, rows, 160))
    assert got.shape == (1, rows, 47) and got.dtype == torch.float32
    diff = (got[0].double() - expected).abs()
    if dequantized:  # float GEMM
        assert float(diff.max()) < 1e-3
    else:  # the integer kernel: within the activation rounding bound
        bound = _activation_bound(x.double(), w.double()) + 1e-3
        assert bool((diff <= bound).all()), float((diff - bound).max())
        # and not vacuously: the bound is well below the outputs' size
        assert float(bound.mean()) < 0.25 * float(expected.abs().mean())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("packed", [False, True])
def test_gated_projection_is_the_projection_then_the_activation(
    fmt: str, activation: str, packed: bool
) -> None:
    # act(gate) * up in one native call (on AMX tiles from 32 rows, where
    # I = 48 is whole panels; I = 40 is not) against the layer's output,
    # then the torch activation.
    gen = torch.Generator().manual_seed(3)
    act = silu_and_mul if activation == "silu" else gelu_tanh_and_mul
    for inter in (48, 40):
        dense = torch.nn.Linear(256, 2 * inter, bias=True)
        with torch.no_grad():
            dense.weight.copy_(torch.randn(2 * inter, 256, generator=gen) / 8)
            dense.bias.copy_(torch.randn(2 * inter, generator=gen))
        layer = QuantLinear.from_linear(dense, fmt)
        if packed:
            layer.pack_for_cpu({})
        for rows in (3, 40):
            x = torch.randn(2, rows, 256, generator=gen)
            want = act(layer(x))
            got = gated_projection(layer, x, activation)
            assert got.shape == (2, rows, inter) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # past the layer's dequantize limit: the float GEMM, then the activation
        layer.dequantize_above = 2
        assert layer.gated(x, activation) is None
        torch.testing.assert_close(gated_projection(layer, x, activation), act(layer(x)))
    layer.dequantize_above = None
    with pytest.raises(InvalidArgumentError, match="activation"):
        layer.gated(x[:, :3], "relu")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_projection_of_a_float_layer_activates_natively(activation: str) -> None:
    # A float32 projection on the CPU: its output, then the native activation
    # (one pass into contiguous rows), against torch's.
    gen = torch.Generator().manual_seed(4)
    act = silu_and_mul if activation == "silu" else gelu_tanh_and_mul
    dense = torch.nn.Linear(48, 2 * 40, bias=True)
    for shape in ((3, 48), (2, 70, 48)):
        x = torch.randn(*shape, generator=gen)
        got = gated_projection(dense, x, activation)
        assert got.shape == (*shape[:-1], 40) and got.is_contiguous()
        torch.testing.assert_close(got, act(dense(x)), rtol=1e-5, atol=1e-6)
    out = torch.empty(3, 40)
    with pytest.raises(InvalidArgumentError, match="activation"):
        gate_rows_cpu(out.numpy(), torch.zeros(3, 80).numpy(), "relu", 1)
    with pytest.raises(InvalidArgumentError, match=r"\[T, 2 I\]"):
        gate_rows_cpu(out.numpy(), torch.zeros(3, 81).numpy(), "silu", 1)
    # an output the kernel cannot write as one slice: the error names it
    strided = torch.empty(40, 3).t()
    with pytest.raises(InvalidArgumentError, match="out must be C-contiguous"):
        gate_rows_cpu(strided.numpy(), torch.zeros(3, 80).numpy(), "silu", 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_weights_give_the_same_bits(fmt: str) -> None:
    """A layer packed into the kernels' panels (47 outputs: two panels and
    fifteen columns left in rows) computes the same bits as in llama.cpp's
    rows, at every row count; its dequantized weight and an embedding's
    looked-up rows are the same too; the packed bytes are the same bytes
    in another order."""
    gen = torch.Generator().manual_seed(5)
    dense = torch.nn.Linear(96, 47, bias=True)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(47, 96, generator=gen))
    rows_layout = QuantLinear.from_linear(dense, fmt)
    packed = QuantLinear.from_linear(dense, fmt)
    packed.pack_for_cpu({})
    assert packed.packed and packed.weight.shape == rows_layout.weight.shape
    assert not torch.equal(packed.weight, rows_layout.weight)
    assert torch.equal(
        packed.weight.flatten().sort().values, rows_layout.weight.flatten().sort().values
    )
    for rows in (1, 3, 8, 20):
        x = torch.randn(rows, 96, generator=gen)
        assert torch.equal(packed(x), rows_layout(x))
    assert torch.equal(
        dequantize(packed.weight, fmt, 96, packed=True), dequantize(rows_layout.weight, fmt, 96)
    )
    assert torch.equal(
        dequantize(packed.weight, fmt, 96, packed=True, rows=range(10, 40)),
        dequantize(rows_layout.weight, fmt, 96)[10:40],
    )
    table = QuantEmbedding(47, 96, fmt)
    table.weight = rows_layout.weight
    ids = torch.tensor([[0, 46, 17], [16, 31, 32]])
    looked_up = table(ids)
    table.pack_for_cpu({})
    assert table.packed and torch.equal(table(ids), looked_up)


@pytest.mark.parametrize("fmt", FORMATS)
def test_scaled_blocks_hold_the_scaled_weight(fmt: str) -> None:
    """scale_blocks: the codes kept, each scale (and q4_1 offset) times the
    factor, rounded to float16 again; the input untouched."""
    weight = torch.randn(6, 96, generator=torch.Generator().manual_seed(8))
    blocks = quantize(weight, fmt)
    before = blocks.clone()
    scaled = scale_blocks(blocks, fmt, 0.3)
    assert torch.equal(blocks, before)
    want = dequantize(blocks, fmt, 96) * 0.3
    got = dequantize(scaled, fmt, 96)
    # per block: |scale| and |offset| each within 2^-11 relative
    assert torch.allclose(got, want, rtol=0, atol=want.abs().max().item() * 2**-10)
    codes = slice(4, None) if fmt == "q4_1" else slice(2, None)
    width = quant_linear.BLOCK_BYTES[fmt]
    assert torch.equal(
        scaled.reshape(6, -1, width)[..., codes], blocks.reshape(6, -1, width)[..., codes]
    )


def _k_quant_bytes(fmt: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """Random K-quant super-blocks: Q6_K (any 6-bit values and signed
    scales, d ~ 1e-3) or Q4_K (any nibbles, 6-bit scales and mins, d and
    dmin ~ 1e-3)."""
    rng = np.random.default_rng(seed)
    width = quant_linear.BLOCK_BYTES[fmt]
    raw = rng.integers(0, 256, size=(rows, k // 256, width), dtype=np.uint8)
    heads = slice(208, 210) if fmt == "q6_k" else slice(0, 4)
    count = (heads.stop - heads.start) // 2
    d = (rng.uniform(0.5, 1.5, size=(rows, k // 256, count)) * 1e-3).astype(np.float16)
    raw[..., heads] = d.view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize(("fmt", "qtype"), [("q6_k", Q.Q6_K), ("q4_k", Q.Q4_K)])
def test_k_quant_layers_run_the_kernels_and_scale(fmt: str, qtype: Q) -> None:
    """A Q6_K or Q4_K weight (as a K-quant GGUF file holds it): dequantized
    exactly as the gguf package does; a QuantLinear over it gives x @ W^T
    within the activations' quantization, the same bits packed into panels
    or not; an embedding looks up its rows; scale_blocks scales each d (and
    Q4_K's dmin), the rest kept."""
    n, k = 40, 512
    blocks = _k_quant_bytes(fmt, n, k, 5)
    dense = dequantize(blocks, fmt, k)
    reference = gguf.quants.dequantize(blocks.numpy(), qtype)
    assert np.array_equal(dense.numpy(), reference)
    layer = QuantLinear(k, n, bias=False, fmt=fmt)
    layer.weight.data = blocks.clone()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    got = layer(x)
    want = x @ dense.T
    assert torch.allclose(got, want, rtol=0, atol=0.02 * want.abs().max().item())
    layer.pack_for_cpu({})
    assert torch.equal(layer(x), got)
    emb = QuantEmbedding(n, k, fmt)
    emb.weight.data = blocks.clone()
    emb.pack_for_cpu({})
    assert torch.equal(emb(torch.tensor([3, 39, 3])), dense[[3, 39, 3]])
    scaled = scale_blocks(blocks, fmt, 0.3)
    width = quant_linear.BLOCK_BYTES[fmt]
    codes = slice(0, 208) if fmt == "q6_k" else slice(4, None)
    assert torch.equal(
        scaled.reshape(n, -1, width)[..., codes], blocks.reshape(n, -1, width)[..., codes]
    )
    # (Q4_K's two scaled terms round apart: within 2^-10 of the larger)
    atol = 0.0 if fmt == "q6_k" else 2**-10 * dense.abs().max().item()
    assert torch.allclose(dequantize(scaled, fmt, k), dense * 0.3, rtol=2**-10, atol=atol)
    with pytest.raises(InvalidArgumentError, match="multiples of 256"):
        QuantLinear(96, 4, bias=False, fmt=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_embedding_looks_up_dequantized_rows(fmt: str) -> None:
    table = torch.randn(50, 64, generator=torch.Generator().manual_seed(1))
    emb = QuantEmbedding(50, 64, fmt)
    emb.weight.data = quantize(table, fmt)
    ids = torch.tensor([[0, 49, 7], [7, 7, 3]])
    assert torch.equal(emb(ids), dequantize(emb.weight, fmt, 64)[ids])
    with pytest.raises(InvalidArgumentError):
        emb(torch.tensor([50]))


def test_formats_need_block_multiples() -> None:
    with pytest.raises(InvalidArgumentError, match="multiples of 32"):
        QuantLinear(80, 16, bias=False, fmt="q8_0")
    with pytest.raises(InvalidArgumentError, match="unknown block format"):
        QuantLinear(64, 16, bias=False, fmt="q5_k")


# ---- GGUF files: blocks kept as stored ------------------------------------------------------

_BLOCK_TYPES = {
    "qkv_proj": Q.Q4_0,  # Phi-3's fused tensors
    "gate_up_proj": Q.Q8_0,
    "q_proj": Q.Q4_0,
    "k_proj": Q.Q4_0,
    "v_proj": Q.Q4_0,
    "o_proj": Q.Q4_1,
    "gate_proj": Q.Q8_0,
    "up_proj": Q.Q8_0,
    "down_proj": Q.Q4_1,
}


def _quantized_gguf(
    path: Path, tied: bool = True, overrides: dict[str, Q] | None = None, arch: str = "llama"
) -> None:
    """A small Llama (or Phi-3: fused q/k/v and gate/up, llama.cpp's `phi3`
    names) GGUF whose linear weights are in the block formats (and the
    embedding in Q8_0)."""
    config_class, options = (
        (Phi3Config, {"pad_token_id": None}) if arch == "phi3" else (LlamaConfig, {})
    )
    config, weights = _random_model(
        config_class, tied, head_dim=16, intermediate_size=128, **options
    )
    tensors, types = {}, {}
    for name, weight in weights.items():
        if arch == "phi3":
            pass  # llama.cpp keeps Phi-3's rotary rows as they are
        elif ".q_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif ".k_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        gguf_name = _gguf_name(name)
        tensors[gguf_name] = weight.numpy()
        module = name.rsplit(".", 2)[-2]
        if module in _BLOCK_TYPES:
            types[gguf_name] = _BLOCK_TYPES[module]
        elif module in ("embed_tokens", "lm_head"):
            types[gguf_name] = Q.Q8_0
    types.update(overrides or {})
    _write_gguf(path, arch, config, tensors, types)


def test_kept_blocks_dequantize_to_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "blocks.gguf"
    # Q5_0 and Q5_1 have no kernel: requantized to Q8_0 at load.
    overrides = {"blk.1.ffn_up.weight": Q.Q5_0, "blk.1.attn_v.weight": Q.Q5_1}
    _quantized_gguf(path, overrides=overrides)
    dense = load_gguf(path)
    kept = load_gguf(path, keep_blocks=True)
    assert set(kept.state_dict) == set(dense.state_dict)
    requantized = {"model.layers.1.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.weight"}
    formats = {}
    for name, tensor in kept.state_dict.items():
        if isinstance(tensor, BlockTensor):
            formats[name] = tensor.fmt
            assert tensor.data.dtype == torch.uint8 and tensor.shape == dense.state_dict[name].shape
            got = dequantize(tensor.data, tensor.fmt, tensor.in_features)
        else:
            got = tensor
        want = dense.state_dict[name]
        if name in requantized:
            # the file's values rounded once more, to a Q8_0 step of their block
            assert torch.equal(got, _q8_0_values(want)), name
            continue
        # Q4_0 rewritten as Q4_1 and the Q/K rows unpermuted on the bytes:
        # exactly the reference dequantization of the file.
        assert torch.equal(got, want), name
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "q4_1"  # from Q4_0
    assert formats["model.layers.0.mlp.gate_proj.weight"] == "q8_0"
    assert formats["model.embed_tokens.weight"] == "q8_0"
    assert all(formats[name] == "q8_0" for name in requantized)
    assert "model.norm.weight" not in formats

    plan = block_plan(kept.state_dict, tied=True, module_of=LlamaForCausalLM.module_of)
    assert plan["layers.0.self_attn.qkv_proj"] == "q4_1"
    assert plan["layers.0.mlp.gate_up_proj"] == "q8_0"
    assert plan["layers.1.mlp.down_proj"] == "q4_1"
    assert plan["layers.1.mlp.gate_up_proj"] == "q8_0"
    # Q4_1 queries and keys beside Q8_0 values: the merged layer all in Q8_0
    assert plan["layers.1.self_attn.qkv_proj"] == "q8_0"
    assert plan["embed_tokens"] == plan["lm_head"] == "q8_0"


def _q8_0_values(weight: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(weight, "q8_0"), "q8_0", weight.shape[1])


Greedy = list[tuple[list[int], list[float]]]  # per prompt: tokens and their logprobs


def _run(path: Path, prompts: list[list[int]], **options) -> tuple[LLM, Greedy]:
    """Greedy runs: per prompt, the sampled tokens and their logprobs. The
    KV cache stays float32 unless asked (these tests measure the weights;
    tests/kernels/test_kv_cache_dtype.py the cache)."""
    options.setdefault("kv_cache_dtype", "float32")
    llm = LLM(str(path), num_kv_blocks=64, max_num_seqs=4, **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()
    runs = []
    for o in outputs:
        tokens = o.outputs[0].token_ids
        runs.append(
            (tokens, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, tokens, strict=True)])
        )
    return llm, runs


def _round_like_the_kernel(module: torch.nn.Module, args: tuple) -> tuple:
    """A transformers Linear's input rounded the way the block kernel rounds
    activations: per 32-wide block, int8 with scale max|x| / 127."""
    (x,) = args
    return (models.round_like_the_block_kernel(x),)


def _hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], round_inputs: bool) -> Greedy:
    """transformers' greedy logprobs; with `round_inputs`, every Linear's
    input rounded as the kernel rounds it (then only summation order differs)."""
    hooks = [
        module.register_forward_pre_hook(_round_like_the_kernel)
        for module in hf.modules()
        if round_inputs and isinstance(module, torch.nn.Linear)
    ]
    try:
        return [models.hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    finally:
        for hook in hooks:
            hook.remove()


def _assert_same_greedy(got: Greedy, expected: Greedy, tolerance: float = 1e-3) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=tolerance)


MAX_TOKENS = 6
# Every step of these runs has fewer than 32 tokens (DEQUANTIZE_ABOVE_ROWS is 32
# or more on every CPU, and a CPU with AMX tiles takes calls of 32 rows or more
# to them: quant_matmul_amx::MIN_ROWS), so each linear layer runs the integer
# kernel (and rounds its input).
# Summation order moves an activation across a rounding boundary now and
# then: one step of int8 in one element, which the following positions
# inherit. A wrong scale or block moves logprobs by whole units.
ROUNDING_DRIFT = 0.03


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("phi3", False)])
def test_gguf_engine_keeps_blocks_and_tracks_transformers(
    tmp_path: Path, arch: str, tied: bool
) -> None:
    path = tmp_path / "blocks.gguf"
    _quantized_gguf(path, tied=tied, arch=arch)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 11, 15)]
    # transformers on the file's weights, dequantized by the GGUF reference
    dense = load_gguf(path)
    hf = AutoModelForCausalLM.from_config(dense.config).eval()
    hf.load_state_dict(dense.state_dict, strict=False)
    hf.tie_weights()

    llm, blocks = _run(path, prompts)
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model.lm_head, QuantLinear)
    # Packed at load where the kernel reads panels; a tied head shares its
    # embedding's one packed copy.
    assert model.layers[0].self_attn.qkv_proj.packed == quant_linear.PACK_FOR_CPU
    assert model.embed_tokens.packed == model.lm_head.packed == quant_linear.PACK_FOR_CPU
    same = model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert same == tied
    _assert_same_greedy(blocks, _hf_greedy(hf, prompts, round_inputs=True), ROUNDING_DRIFT)
    # Dequantized at load ("none"), ferrox matches transformers as closely as on any checkpoint.
    llm, none = _run(path, prompts, quantization="none")
    assert not any(
        isinstance(m, (QuantLinear, QuantEmbedding)) for m in llm.engine.runner.model.modules()
    )
    _assert_same_greedy(none, _hf_greedy(hf, prompts, round_inputs=False))
    _, explicit = _run(path, prompts, quantization="gguf")
    assert explicit == blocks


def _k_quant_gguf(path: Path, type_of: Callable[[str], Q | None]) -> None:
    """A small tied Llama GGUF with rows of 256 (what the K-quants need),
    each weight in `type_of(its module)` (None: float32)."""
    config, weights = _random_model(
        LlamaConfig, True, hidden_size=256, intermediate_size=512, head_dim=64
    )
    tensors, types = {}, {}
    for name, weight in weights.items():
        if ".q_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif ".k_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        gguf_name = _gguf_name(name)
        tensors[gguf_name] = weight.numpy() * 0.05
        qtype = type_of(name.rsplit(".", 2)[-2])
        if qtype is not None:
            types[gguf_name] = qtype
    _write_gguf(path, "llama", config, tensors, types)


def _q4_1_values(tensor: BlockTensor) -> torch.Tensor:
    """A Q4_K tensor's values as the Q4_1 blocks it loads into by default."""
    q4_1 = q4_k_as_q4_1(tensor.data.numpy().reshape(-1))
    blocks = torch.from_numpy(q4_1).reshape(tensor.data.shape[0], -1)
    return dequantize(blocks, "q4_1", tensor.in_features)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_q4_k_weights_run_on_blocks_and_track_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    """A GGUF whose linear weights are Q4_K (llama.cpp's Q4_K_M files hold
    most of theirs so) loads its super-blocks as stored. By default each
    runs as eight Q4_1 blocks (the scales rounded to float16); with
    quantization="gguf" the CPU kernels run the Q4_K blocks themselves (here
    on any CPU, the portable loop's included), the file's values exactly.
    Greedy tokens track transformers on the values the engine holds."""
    monkeypatch.setattr(model_loader, "STORED_FORMATS", ("q6_k", "q4_k"))
    fmt = "q4_k" if quantization == "gguf" else "q4_1"
    path = tmp_path / "q4k.gguf"
    _k_quant_gguf(path, lambda module: Q.Q4_K if module in _BLOCK_TYPES else None)
    kept = load_gguf(path, keep_blocks=True)
    block = kept.state_dict["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(block, BlockTensor) and block.fmt == "q4_k"
    dense = load_gguf(path)  # the gguf package's own Q4_K dequantization
    reference = dense.state_dict["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(dequantize(block.data, "q4_k", block.in_features), reference)
    plan = block_plan(
        kept.state_dict,
        True,
        LlamaForCausalLM.module_of,
        model_loader._runnable_formats("native", quantization),
    )
    assert plan["layers.0.mlp.gate_up_proj"] == fmt
    values = _q4_1_values(block)
    assert torch.allclose(values, reference, rtol=0, atol=reference.abs().max().item() * 2**-10)
    hf = AutoModelForCausalLM.from_config(dense.config).eval()
    if quantization is None:  # (the values the engine holds: Q4_1's rounding)
        state = {
            name: _q4_1_values(t) if isinstance(t, BlockTensor) else t
            for name, t in kept.state_dict.items()
        }
        hf.load_state_dict(state, strict=False)
    else:
        hf.load_state_dict(dense.state_dict, strict=False)
    hf.tie_weights()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 16)]
    llm, blocks = _run(path, prompts, quantization=quantization)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear) and layer.mlp.gate_up_proj.fmt == fmt
    _assert_same_greedy(blocks, _hf_greedy(hf, prompts, round_inputs=True), ROUNDING_DRIFT)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_a_q4_k_m_style_file_runs_on_blocks_and_tracks_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    """llama.cpp's Q4_K_M files hold most weights in Q4_K and the values, the
    down projections and the embedding in Q6_K. By default (and on a GPU)
    the Q6_K modules come to Q8_0 and the Q4_K ones to Q4_1; with
    quantization="gguf" (the blocks as stored) the down projections and the
    tied embedding / LM head stay in Q6_K and the gate/up projections in
    Q4_K on the CPU (here on any CPU, the portable loop's included), their
    values the gguf package's. A merged q/k/v whose parts differ
    (Q4_K queries and keys) comes to Q8_0 whole. Every layer stays in blocks
    (the fused decode runs) and greedy tokens track transformers on the
    values the engine holds."""
    monkeypatch.setattr(model_loader, "STORED_FORMATS", ("q6_k", "q4_k"))
    q6_k = "q6_k" if quantization == "gguf" else "q8_0"
    q4_k = "q4_k" if quantization == "gguf" else "q4_1"
    formats = model_loader._runnable_formats("native", quantization)

    def type_of(module: str) -> Q | None:
        if module in ("v_proj", "down_proj", "embed_tokens"):
            return Q.Q6_K
        return Q.Q4_K if module in _BLOCK_TYPES else None

    path = tmp_path / "q4km.gguf"
    _k_quant_gguf(path, type_of)
    kept = load_gguf(path, keep_blocks=True)
    plan = block_plan(kept.state_dict, True, LlamaForCausalLM.module_of, formats)
    assert plan["layers.0.self_attn.qkv_proj"] == "q8_0"
    assert plan["layers.0.mlp.down_proj"] == plan["lm_head"] == q6_k
    assert plan["layers.0.mlp.gate_up_proj"] == q4_k
    on_gpu = block_plan(kept.state_dict, True, LlamaForCausalLM.module_of, ("q4_1", "q8_0"))
    assert on_gpu["layers.0.mlp.down_proj"] == on_gpu["lm_head"] == "q8_0"
    # What the engine holds: the kept blocks, requantized where the plan says.
    dense = load_gguf(path)
    state = {}
    for name, tensor in kept.state_dict.items():
        if not isinstance(tensor, BlockTensor):
            state[name] = tensor
            continue
        values = dequantize(tensor.data, tensor.fmt, tensor.in_features)
        fmt = plan[LlamaForCausalLM.module_of(name)]
        if fmt == tensor.fmt:
            state[name] = values
        elif (tensor.fmt, fmt) == ("q4_k", "q4_1"):
            state[name] = _q4_1_values(tensor)
        else:
            state[name] = _q8_0_values(values)
        # each within a Q6_K (or Q4_K) step and a Q8_0 step of the file's
        # values; the K-quant blocks kept are the file's values exactly
        file_values = dense.state_dict[name]
        assert (state[name] - file_values).abs().max() <= 0.05 * file_values.abs().max()
        assert torch.equal(values, file_values), name
    hf = AutoModelForCausalLM.from_config(dense.config).eval()
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 16)]
    llm, blocks = _run(path, prompts, quantization=quantization)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.fmt == "q8_0"
    assert model.layers[0].mlp.down_proj.fmt == model.lm_head.fmt == q6_k
    assert model.layers[0].mlp.gate_up_proj.fmt == q4_k
    assert model.fused_decode is not None
    _assert_same_greedy(blocks, _hf_greedy(hf, prompts, round_inputs=True), ROUNDING_DRIFT)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_at_load_tracks_transformers(tiny_models: dict[str, Path], fmt: str) -> None:
    path = tiny_models["llama-gqa-tied"]  # hidden 96
    gen = torch.Generator().manual_seed(4)
    # (a first step of 31 rows: the integer kernel on every CPU, see ROUNDING_DRIFT)
    prompts = [torch.randint(2, models.VOCAB_SIZE, (n,), generator=gen).tolist() for n in (4, 27)]
    llm, got = _run(path, prompts, quantization=fmt)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    # qkv, o, gate_up and down in every layer, and the LM head
    assert len(layers) == 4 * len(model.layers) + 1
    hf = models.hf_model_with_rounded_weights(path, fmt)
    _assert_same_greedy(got, _hf_greedy(hf, prompts, round_inputs=True), ROUNDING_DRIFT)


def _hf_greedy_tiles(hf: torch.nn.Module, prompts: list[list[int]]) -> Greedy:
    """transformers' greedy logprobs rounded as ferrox computes a step of 32
    rows or more on a CPU with AMX tiles: the prompt's decoder-layer linears
    on bfloat16 weights and inputs (float32 sums); the LM head (the sampled
    rows alone) and every decode step on the integer kernel."""

    def tiles_or_integer(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        (x,) = args
        if x.shape[-2] > 1 and module is not hf.lm_head:  # a prompt's rows
            to_bf16 = lambda t: t.to(torch.bfloat16).to(torch.float32)  # noqa: E731
            return F.linear(to_bf16(x), to_bf16(module.weight), module.bias)
        return F.linear(models.round_like_the_block_kernel(x), module.weight, module.bias)

    hooks = [
        module.register_forward_hook(tiles_or_integer)
        for module in hf.modules()
        if isinstance(module, torch.nn.Linear)
    ]
    try:
        return [models.hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    finally:
        for hook in hooks:
            hook.remove()


def test_amx_tiles_track_transformers_in_bfloat16(tiny_models: dict[str, Path]) -> None:
    """On a CPU with AMX tiles, the prompts' step (45 rows) runs the block
    matmuls on them: greedy tokens and logprobs track transformers with the
    tiles' rounding in that step (and the integer kernel's in the others);
    the integer kernel's rounding in the prompts' step is further off."""
    if cpu_isa() != "amx":
        pytest.skip("this CPU has no AMX tiles (the integer kernels' tests above cover it)")
    path = tiny_models["llama-gqa-tied"]
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, models.VOCAB_SIZE, (n,), generator=gen).tolist() for n in (20, 25)]
    _, got = _run(path, prompts, quantization="q8_0")
    hf = models.hf_model_with_rounded_weights(path, "q8_0")
    tiles = _hf_greedy_tiles(hf, prompts)
    _assert_same_greedy(got, tiles, 1e-3)  # (measured: within 1e-6)
    integer = _hf_greedy(hf, prompts, round_inputs=True)  # (0.07-0.21 nats off)
    for (_, logprobs), (_, want), (_, other) in zip(got, tiles, integer, strict=True):
        assert abs(logprobs[0] - want[0]) < 1e-4 < abs(logprobs[0] - other[0]), (
            logprobs[0],
            want[0],
            other[0],
        )


_WITH_EXPERTS = ("qwen3-moe", "qwen3-next")
# (float experts run one expert at a time, not natively: no fused MoE case without blocks)
_FUSED_CASES = [
    (name, quantization, kv_cache_dtype)
    for name in (
        "llama-gqa-tied",
        "qwen2",
        "qwen3",
        "qwen3-moe",
        "granite",
        "qwen3.5",
        "qwen3-next",
    )
    # auto: float16 under blocks
    for quantization, kv_cache_dtype in (("q8_0", "float32"), (None, "auto"), ("q8_0", "auto"))
    if not (name in _WITH_EXPERTS and quantization is None)
]


@pytest.mark.parametrize(("name", "quantization", "kv_cache_dtype"), _FUSED_CASES)
def test_fused_decode_layers_match_the_module_path(
    tiny_models: dict[str, Path],
    name: str,
    quantization: str | None,
    kv_cache_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps run each layer in one native call; the same kernels one
    module at a time give the same tokens and logprobs (Qwen2: q/k/v bias;
    Qwen3: q/k norms; Granite: its attention scale and folded residual
    multiplier; Qwen3-MoE: block-format experts in a second native
    call, against one call per expert and projection; the Qwen3.5 and
    Qwen3-Next hybrids: Gated DeltaNet layers on the state pool, gated
    attention with a partial rotary embedding), over blocks and over
    float32 weights (a small model keeps them as well as their oneDNN
    packing), with a float32 or a float16 KV cache."""
    gen = torch.Generator().manual_seed(5)
    # (a first step of 31 rows: on a CPU with AMX tiles, 32 would take them
    # there and the integer kernel in the steps behind the prefix cache)
    prompts = [
        torch.randint(2, models.VOCAB_SIZE, (n,), generator=gen).tolist() for n in (3, 9, 19)
    ]
    llm, fused = _run(
        tiny_models[name], prompts, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    calls: list[int] = []
    monkeypatch.setattr(model.fused_decode, "run", _counted(model.fused_decode.run, calls))
    again = _run_again(llm, prompts)
    if llm.engine.runner.kv_dtype == torch.float32:
        # (a float16 cache holds rounded K/V the first prefill had whole)
        _assert_close(again, fused)
    # Every step: the prompts' full blocks now come from the prefix cache,
    # so even the first step computes at most 16 tokens a row (a hybrid's
    # runs here only once every row is a decode: all but the first).
    steps = MAX_TOKENS - 1 if model.fused_decode.hybrid else MAX_TOKENS
    assert len(calls) == steps
    model.fused_decode = None
    experts = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoe)]
    assert all(moe.native is not None for moe in experts)
    assert bool(experts) == (name in _WITH_EXPERTS)
    for moe in experts:
        moe.native = None  # one QuantLinear call per expert and projection
    _assert_close(_run_again(llm, prompts), again)
    assert len(calls) == steps


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss", "gemma3-window"])
def test_long_rows_behind_a_context_run_fused(
    tiny_models: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose long rows all follow a context computed before (prompt
    tails of 20 and 10 tokens behind a cached 32-token prefix) runs the
    fused layers, whose attention takes the paged kernel as the module path
    gives it such rows; the same tokens and logprobs as the module path
    (gpt-oss: sinks, windows and experts; Gemma 3: windows and its norms).
    A fresh 20-token prompt runs fused too; a 200-token one, a step over
    the limit, on the module path."""
    gen = torch.Generator().manual_seed(11)

    def tokens(n: int) -> list[int]:
        return torch.randint(2, models.VOCAB_SIZE, (n,), generator=gen).tolist()

    prefix = tokens(32)
    prompts = [prefix + tokens(20), prefix + tokens(10)]
    llm, _ = _run(tiny_models[name], [prefix], quantization="q8_0")
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    calls: list[int] = []
    monkeypatch.setattr(model.fused_decode, "run", _counted(model.fused_decode.run, calls))
    fused = _run_again(llm, prompts)
    assert len(calls) == MAX_TOKENS  # the tails' step too
    calls.clear()
    _run_again(llm, [tokens(20)])
    assert len(calls) == MAX_TOKENS
    calls.clear()
    _run_again(llm, [tokens(cpu_decoder.FUSED_MAX_TOKENS_LONG_ROWS + 40)])
    assert len(calls) == MAX_TOKENS - 1  # all but the long prompt's step
    model.fused_decode = None
    llm.reset_prefix_cache()
    _run_again(llm, [prefix])
    _assert_close(_run_again(llm, prompts), fused)


def _assert_close(got: Greedy, expected: Greedy) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def _counted(fn, calls: list):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


def _run_again(llm: LLM, prompts: list[list[int]]) -> Greedy:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_used_blocks == 0
    return [
        (
            o.outputs[0].token_ids,
            [
                lp[t].logprob
                for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        )
        for o in outputs
    ]


def test_fused_decode_needs_weights_it_can_read(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tiny_models["llama-gqa-tied"])
    assert LLM(path, num_kv_blocks=16).engine.runner.model.fused_decode is not None
    # float experts run one expert at a time: no fused decode
    moe = LLM(str(tiny_models["qwen3-moe"]), num_kv_blocks=16)
    assert moe.engine.runner.model.fused_decode is None
    # Weights too large to keep twice live only in oneDNN's layout: the
    # module path runs them.
    monkeypatch.setattr(cpu_linear, "SMALL_WEIGHT", 0)
    assert LLM(path, num_kv_blocks=16).engine.runner.model.fused_decode is None


def test_quantization_options_are_checked(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="quantization must be one of"):
        EngineConfig.create(model="x", quantization="awq")
    path = tiny_models["llama-gqa-tied"]
    with pytest.raises(InvalidArgumentError, match="needs a GGUF model file"):
        LLM(str(path), quantization="gguf")
    with pytest.raises(InvalidArgumentError, match="float32"):
        LLM(str(path), quantization="q8_0", dtype="bfloat16")
    with pytest.raises(InvalidArgumentError, match="multiples of 32"):
        LLM(str(tiny_models["llama-mha-untied"]), quantization="q4_1")  # hidden 80
    # The file's blocks run on the CPU in float32 only: asked for elsewhere,
    # refused rather than silently dequantized.
    gguf_path = tmp_path / "blocks.gguf"
    _quantized_gguf(gguf_path)
    with pytest.raises(InvalidArgumentError, match="float32"):
        LLM(str(gguf_path), quantization="gguf", dtype="bfloat16")
    with pytest.raises(InvalidArgumentError, match="needs a GGUF model file"):
        LLM(str(gguf_path), quantization="gguf", load_format="dummy")


# ---- the default model ----------------------------------------------------------------------


def test_default_model_keeps_blocks_close_to_transformers(smollm2_path: Path) -> None:
    """The bundled SmolLM2 file runs on its blocks by default; its prompt
    log-likelihood stays within a few percent of transformers on the
    dequantized weights (the kernel rounds activations to int8)."""
    from transformers import LlamaForCausalLM as HfLlama

    reader = gguf.GGUFReader(str(smollm2_path))
    stored = {t.name: Q(t.tensor_type) for t in reader.tensors}
    assert stored["blk.0.attn_q.weight"] in (Q.Q8_0, Q.Q4_0, Q.Q4_1)

    dense = load_gguf(smollm2_path)
    hf = HfLlama(dense.config).eval()
    hf.load_state_dict(dense.state_dict, strict=False)
    hf.tie_weights()
    text = (
        "The sun rose over the hills, and the farmers walked out to their fields. "
        "By noon the heat was heavy, so they rested in the shade of an old oak tree "
        "and shared bread, cheese and cold water from the well."
    )
    ids = dense.tokenizer.encode(text)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    expected = logits.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    llm = LLM(str(smollm2_path), max_num_seqs=2)
    assert isinstance(llm.engine.runner.model.layers[0].mlp.down_proj, QuantLinear)
    out = llm.generate(
        [ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False
    )[0]
    got = torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
    assert got.shape == expected.shape
    nll_ours, nll_hf = float(-got.mean()), float(-expected.mean())
    assert abs(nll_ours - nll_hf) < 0.03 * nll_hf, (nll_ours, nll_hf)
    assert float((got - expected).abs().mean()) < 0.1
    assert llm.engine.stats().num_used_blocks == 0
