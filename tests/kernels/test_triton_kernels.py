"""The Triton KV-store, paged-attention and LoRA kernels against torch:
small cases everywhere (on the CPU under the Triton interpreter, compiled on a
GPU), and full-size cases on a GPU only."""

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from ferrox.common.errors import InvalidArgumentError
from ferrox.layers.attention import AttentionMetadata, get_attention_backend, torch_backend

# Triton decides between compiling and interpreting a kernel when it is
# decorated: its own helpers (tl.cdiv, tl.max, ...) when triton is imported,
# ferrox's kernels when ferrox.triton_kernels is (importing ferrox imports neither),
# and the interpreter reads the variable again at launch. So it is set here,
# before those imports, and kernels an earlier module imported compiled are
# dropped to be decorated anew. Should triton itself have been imported
# compiled by then, these tests rerun this file in a fresh interpreter. The
# variable is restored after the imports and set only while these tests run.
ON_GPU = torch.cuda.is_available()
_saved_interpret = os.environ.get("TRITON_INTERPRET")
IN_PROCESS = ON_GPU or _saved_interpret == "1" or "triton" not in sys.modules
if IN_PROCESS and not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [m for m in sys.modules if m.startswith("ferrox.triton_kernels")]:
        del sys.modules[_name]

from ferrox.triton_kernels.kv_store import store_kv  # noqa: E402
from ferrox.triton_kernels.lora import lora_expand, lora_shrink  # noqa: E402
from ferrox.triton_kernels.paged_attention import num_kv_splits_for, paged_attention  # noqa: E402
from ferrox.triton_kernels.quant_matmul import (  # noqa: E402
    dequant_matmul,
    dequantize_split,
    split_blocks,
)

if _saved_interpret is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _saved_interpret

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(autouse=True)
def in_process_only(request: pytest.FixtureRequest) -> None:
    if not IN_PROCESS and request.function is not test_in_a_fresh_interpreter:
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")


def test_in_a_fresh_interpreter() -> None:
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@dataclass
class Step:
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [N, BS, Hkv, D]
    v_cache: torch.Tensor  # [N, BS, Hkv, D]


def make_step(
    decodes: list[int],
    chunks: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Step:
    """Decode rows of the given context lengths, then chunks of
    (cached tokens, new tokens), on randomly placed blocks of a random cache."""
    gen = torch.Generator().manual_seed(seed)
    rows = [(n - 1, 1) for n in decodes] + chunks
    seq_lens = np.array([c + n for c, n in rows], dtype=np.int32)
    query_lens = np.array([n for _, n in rows], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    blocks_per_row = [-(-int(s) // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + 4
    pages = torch.randperm(num_blocks, generator=gen).numpy().astype(np.int32)
    table = np.zeros((len(rows), max(blocks_per_row) + 1), dtype=np.int32)  # [B, W]
    for i, n in enumerate(blocks_per_row):
        start = sum(blocks_per_row[:i])
        table[i, :n] = pages[start : start + n]
    slots = [
        table[i, p // block_size] * block_size + p % block_size
        for i, (c, n) in enumerate(rows)
        for p in range(c, c + n)
    ]
    num_tokens = int(qsl[-1])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    meta = AttentionMetadata(
        num_reqs=len(rows),
        num_decodes=len(decodes),
        num_tokens=num_tokens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_table=torch.from_numpy(table).to(DEVICE),
        query_start_loc=torch.from_numpy(qsl).to(DEVICE),
        seq_lens=torch.from_numpy(seq_lens).to(DEVICE),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_computed_cpu=np.array([c for c, _ in rows], dtype=np.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_cpu=table,
    )
    return Step(
        meta,
        randn(num_tokens, num_heads, head_dim),
        randn(num_tokens, num_kv_heads, head_dim),
        randn(num_tokens, num_kv_heads, head_dim),
        randn(num_blocks, block_size, num_kv_heads, head_dim),
        randn(num_blocks, block_size, num_kv_heads, head_dim),
    )


def reference(step: Step) -> torch.Tensor:
    """The torch backend in float32 on the same (rounded) inputs."""
    num_heads, head_dim = step.q.shape[1:]
    backend = torch_backend.TorchAttentionBackend(
        num_heads, step.k.shape[1], head_dim, head_dim**-0.5
    )
    q, k, v, k_cache, v_cache = (
        t.to(F32, copy=True) for t in (step.q, step.k, step.v, step.k_cache, step.v_cache)
    )
    return backend.forward(q, k, v, k_cache, v_cache, step.meta)  # [T, H, D]


def run_triton(step: Step, num_kv_splits: int | None = None) -> torch.Tensor:
    meta = step.meta
    store_kv(step.k, step.v, step.k_cache, step.v_cache, meta.slot_mapping)
    return paged_attention(
        step.q,
        step.k_cache,
        step.v_cache,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        num_decodes=meta.num_decodes,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        scale=step.q.shape[2] ** -0.5,
        num_kv_splits=num_kv_splits,
    )


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    # Half outputs also carry their own rounding (up to 2^-9 relative).
    if out.dtype == F32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


def check(step: Step, num_kv_splits: int | None = None) -> None:
    ref = reference(step)
    assert_matches(run_triton(step, num_kv_splits), ref)


# (block size, head dim, query heads per KV head, dtype): a covering subset of
# {16, 32} x {64, 128} x {1, 3, 8} x {f32, f16, bf16}, small enough for the
# interpreter. Two KV heads everywhere.
SHAPES = [
    (16, 64, 1, F32),
    (32, 128, 3, F32),
    (16, 128, 8, F32),
    (32, 64, 8, F16),
    (16, 128, 3, F16),
    (32, 64, 3, BF16),
    (16, 64, 8, BF16),
    (32, 128, 1, BF16),
]


def shape_id(shape: tuple[int, int, int, torch.dtype]) -> str:
    bs, dim, group, dtype = shape
    return f"bs{bs}-d{dim}-g{group}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_store_kv_scatters_and_skips_padding(block_size: int, dtype: torch.dtype) -> None:
    step = make_step([], [(3, 21)], 4, 2, 64, block_size, dtype)
    slots = step.meta.slot_mapping.clone()
    slots[[2, 7]] = -1  # padded rows
    qkv = torch.randn(21, 8, 64).to(dtype=dtype, device=DEVICE)  # [T, H + 2 Hkv, D]
    k, v = qkv[:, 4:6], qkv[:, 6:8]  # strided views, as the models pass them
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    torch_backend.store_kv(k[keep], v[keep], step.k_cache, step.v_cache, slots[keep])
    assert torch.equal(k_cache, step.k_cache)
    assert torch.equal(v_cache, step.v_cache)


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_decode(shape: tuple[int, int, int, torch.dtype], splits: int) -> None:
    bs, dim, group, dtype = shape
    # 1 token, under one split of 64, across several blocks and splits.
    step = make_step([1, 17, 50, 95], [], 2 * group, 2, dim, bs, dtype, seed=splits)
    check(step, num_kv_splits=splits)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_prefill_chunks_mixed_with_decodes(shape: tuple[int, int, int, torch.dtype]) -> None:
    bs, dim, group, dtype = shape
    # A fresh prompt, chunks after cached prefixes (one a single token at a
    # block boundary) and one decode in front.
    chunks = [(0, 23), (37, 9), (bs, 1), (5, 40)]
    check(make_step([29], chunks, 2 * group, 2, dim, bs, dtype))


@pytest.mark.parametrize(
    ("block_size", "head_dim"), [(8, 64), (64, 32), (16, 80), (16, 256)], ids=str
)
def test_other_block_sizes_and_head_dims(block_size: int, head_dim: int) -> None:
    check(make_step([3, 70], [(0, 19), (21, 6)], 4, 2, head_dim, block_size, F32), 2)


def test_padded_decode_rows_give_zeros_and_write_nothing() -> None:
    step = make_step([12, 30, 1], [], 6, 2, 64, 16, F32)
    ref = reference(step)
    step.meta.seq_lens[2] = 0  # a padded row of a captured batch
    step.meta.slot_mapping[2] = -1
    before = step.k_cache.clone()
    for splits in (1, 4):
        out = run_triton(step, splits)
        assert_matches(out[:2], ref[:2])
        assert torch.equal(out[2], torch.zeros_like(out[2]))
    changed = (step.k_cache != before).flatten(2).any(-1).flatten()  # [N * BS]
    assert changed.nonzero().flatten().tolist() == sorted(step.meta.slot_mapping[:2].tolist())


def test_block_table_narrower_than_context_stays_in_bounds() -> None:
    # The memory-profiling pass: fresh prompts, a one-block scratch cache.
    step = make_step([], [(0, 40), (0, 25)], 4, 2, 64, 16, F32)
    step.meta.block_table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    step.meta.slot_mapping.zero_()
    assert torch.isfinite(run_triton(step)).all()


def test_backend_over_a_prefill_then_decodes() -> None:
    heads, kv_heads, dim, bs = 6, 2, 64, 16
    ours = get_attention_backend("triton", DEVICE)(heads, kv_heads, dim, dim**-0.5)
    ref = torch_backend.TorchAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    step = make_step([], [(0, 21)], heads, kv_heads, dim, bs, F32)
    ref_caches = (step.k_cache, step.v_cache)
    caches = (step.k_cache.clone(), step.v_cache.clone())
    table = step.meta.block_table
    for pos in (None, 21, 22):
        if pos is not None:  # the next decode of the same request, on its blocks
            step = make_step([pos + 1], [], heads, kv_heads, dim, bs, F32, seed=pos)
            step.meta.block_table = table
            step.meta.slot_mapping.fill_(int(table[0, pos // bs]) * bs + pos % bs)
        qkv = (step.q, step.k, step.v)
        want = ref.forward(*qkv, *ref_caches, step.meta)
        assert_matches(ours.forward(*qkv, *caches, step.meta), want)
        assert torch.equal(caches[0], ref_caches[0])
        assert torch.equal(caches[1], ref_caches[1])


def test_registry_picks_cpu_for_cpu_and_triton_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attention_backend("auto", cpu).name == "cpu"
    assert get_attention_backend("triton", cpu).name == "triton"
    with pytest.raises(InvalidArgumentError):
        get_attention_backend("flash-attn", cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(InvalidArgumentError):
        get_attention_backend("triton", cpu)
    assert num_kv_splits_for(2, 8, 100_000, cpu) == 1


def check_quant_matmul(fmt: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    """The kernel against x @ W^T in float32 over the weight as the CPU's
    native dequantizer reads the same blocks (inputs rounded to `dtype`)."""
    from ferrox.layers.quant_linear import dequantize, quantize

    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    blocks = quantize(torch.randn(n, k, generator=gen), fmt)
    weight = dequantize(blocks, fmt, k)
    split = split_blocks(blocks.to(DEVICE), fmt, k)
    assert torch.equal(dequantize_split(split).cpu(), weight)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = dequant_matmul(x.to(DEVICE), split, None if b is None else b.to(DEVICE))
    assert out.dtype == dtype and out.shape == (m, n)
    expected = x.float() @ weight.to(dtype).float().T
    if b is not None:
        expected += b.float()
    tol = {F32: 1e-4, F16: 2e-2, BF16: 6e-2}[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "bias"),
    [
        (1, 40, 64, F32, False),  # one decode row; N not a tile multiple
        (5, 96, 96, F32, True),  # K an odd number of 32-wide groups
        (17, 33, 160, BF16, False),
        (40, 70, 128, F32, True),  # rows over one tile
    ],
)
def test_dequant_matmul(fmt: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    check_quant_matmul(fmt, m, n, k, dtype, bias)


def test_dequant_matmul_keeps_leading_dims_and_checks_width() -> None:
    from ferrox.layers.quant_linear import quantize

    split = split_blocks(quantize(torch.randn(8, 64), "q8_0").to(DEVICE), "q8_0", 64)
    x = torch.randn(2, 3, 64, device=DEVICE)
    assert dequant_matmul(x, split).shape == (2, 3, 8)
    assert dequant_matmul(x[:0], split).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="features"):
        dequant_matmul(torch.randn(2, 32, device=DEVICE), split)


def test_block_layers_split_for_triton() -> None:
    """QuantLinear / QuantEmbedding after `split_block_layers` (the GPU's
    load step) against the same layers on the CPU's native kernels; a tied
    head shares its embedding's split, and the blocks are released."""
    from torch import nn

    from ferrox.layers.quant_linear import QuantEmbedding, QuantLinear, dequantize, quantize
    from ferrox.loader.model_loader import split_block_layers

    gen = torch.Generator().manual_seed(3)
    blocks = quantize(torch.randn(50, 64, generator=gen), "q4_1")
    model = nn.Module()
    model.embed = QuantEmbedding(50, 64, "q4_1")
    model.embed.weight.data = blocks
    model.head = QuantLinear(64, 50, False, "q4_1")
    model.head.weight = model.embed.weight  # tied
    model.proj = QuantLinear.from_linear(nn.Linear(64, 96), "q8_0")
    ids = torch.tensor([[0, 7, 49], [3, 3, 11]])
    x = torch.randn(4, 64, generator=gen)
    native = (model.embed(ids), model.head(x), model.proj(x))
    assert split_block_layers(model, torch.float32) == 3
    assert model.head._split is model.embed._split
    assert all(m.weight.numel() == 0 for m in (model.embed, model.head, model.proj))
    torch.testing.assert_close(model.embed(ids), native[0], rtol=0, atol=0)
    assert torch.equal(native[0][0, 1], dequantize(blocks, "q4_1", 64)[7])
    # the native kernel rounds x to int8 per 32 values; the Triton one does not
    for layer, expected in ((model.head, native[1]), (model.proj, native[2])):
        torch.testing.assert_close(layer(x), expected, rtol=0.05, atol=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
class TestQuantMatmulFullSizeOnGpu:
    """Llama-8B-like projections at decode and prefill sizes."""

    @pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
    @pytest.mark.parametrize("m", [1, 16, 300])
    @pytest.mark.parametrize("dtype", [BF16, F16])
    def test_projection(self, fmt: str, m: int, dtype: torch.dtype) -> None:
        check_quant_matmul(fmt, m, 4096, 4096, dtype, bias=m == 16)

    def test_in_a_cuda_graph(self) -> None:
        from ferrox.layers.quant_linear import quantize

        split = split_blocks(quantize(torch.randn(1024, 2048), "q4_1").to(DEVICE), "q4_1", 2048)
        x = torch.randn(8, 2048, device=DEVICE, dtype=BF16)
        out = dequant_matmul(x, split)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = dequant_matmul(x, split)
        x.copy_(torch.randn(8, 2048, device=DEVICE, dtype=BF16))
        graph.replay()
        torch.testing.assert_close(captured, dequant_matmul(x, split))
        assert not torch.equal(captured, out)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
class TestFullSizeOnGpu:
    """Llama-8B-like heads (H=32, Hkv=8, D=128) at serving sizes."""

    def test_auto_picks_triton(self) -> None:
        assert get_attention_backend("auto", DEVICE).name == "triton"

    @pytest.mark.parametrize("splits", [None, 4])
    def test_decode_64_by_2k(self, splits: int | None) -> None:
        lens = torch.randint(1500, 2100, (64,), generator=torch.Generator().manual_seed(1))
        check(make_step(lens.tolist(), [], 32, 8, 128, 16, BF16), splits)

    def test_split_decode_for_a_small_batch_of_long_contexts(self) -> None:
        assert num_kv_splits_for(4, 8, 8000, DEVICE) > 1
        check(make_step([8000, 7001, 5555, 333], [], 32, 8, 128, 16, BF16))

    @pytest.mark.parametrize("dtype", [BF16, F16, F32])
    @pytest.mark.parametrize("block_size", [16, 32])
    def test_prefill_mixed(self, dtype: torch.dtype, block_size: int) -> None:
        chunks = [(0, 2048), (1000, 512), (3001, 257), (64, 1)]
        check(make_step([2000] * 16, chunks, 32, 8, 128, block_size, dtype))

    def test_decode_in_a_cuda_graph(self) -> None:
        step = make_step([900, 1500, 33, 2047], [], 32, 8, 128, 16, BF16)
        out = torch.empty_like(step.q)

        def launch() -> None:
            out.copy_(run_triton(step, num_kv_splits=4))

        launch()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        for seed, lens in ((5, [1800, 7, 1024, 1500]), (6, [1, 2000, 64, 640])):
            new = make_step(lens, [], 32, 8, 128, 16, BF16, seed=seed)
            num_blocks, width = new.k_cache.shape[0], new.meta.block_table.shape[1]
            for name in ("q", "k", "v"):
                getattr(step, name).copy_(getattr(new, name))
            step.k_cache[:num_blocks] = new.k_cache
            step.v_cache[:num_blocks] = new.v_cache
            step.meta.slot_mapping.copy_(new.meta.slot_mapping)
            step.meta.seq_lens.copy_(new.meta.seq_lens)
            step.meta.block_table.zero_()[:, :width] = new.meta.block_table
            graph.replay()
            assert_matches(out, reference(new))


@pytest.mark.parametrize(("k", "r", "n", "dtype"), [(37, 5, 29, F32), (96, 48, 130, F16)])
def test_lora_shrink_and_expand_match_torch(k: int, r: int, n: int, dtype: torch.dtype) -> None:
    """Per token its slot's A and B (slot -1: the base model, nothing added)."""
    gen = torch.Generator().manual_seed(k)
    slots_list = [2, -1, 0, 2, 1, -1, 0]
    x = torch.randn(len(slots_list), k, generator=gen).to(DEVICE, dtype)
    a = torch.randn(3, r, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(3, n, r, generator=gen).to(DEVICE, dtype)
    out = torch.randn(len(slots_list), n, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor(slots_list, dtype=torch.int32, device=DEVICE)
    h = lora_shrink(x, a, slots)
    want = out.float().clone()
    for t, s in enumerate(slots_list):
        if s >= 0:
            ht = a[s].float() @ x[t].float()
            torch.testing.assert_close(h[t], ht, atol=1e-2, rtol=1e-3)
            want[t] += b[s].float() @ ht
    lora_expand(h, b, slots, out)
    tol = 1e-3 if dtype == F32 else 5e-2
    torch.testing.assert_close(out.float(), want, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("mode", ["stacked", "native"])
def test_stacked_adapters_match_the_torch_path(mode: str) -> None:
    """LoraModel's stacked mode (slots in stacks, the Triton kernels) or its
    native one (the CPU's CpuLoraLayer) against its torch mode on the same
    merged layer (three slices), two adapters that adapt different slices
    at different ranks, mixed with base tokens; a removed adapter's slot is
    reused."""
    if mode == "native" and ON_GPU:
        pytest.skip("the native layer runs on the CPU")
    from torch import nn

    from ferrox.common.lora import AdapterSpec, LoraTargets
    from ferrox.layers.lora import LoraModel, LoraSite, LoraSlice, LoraStep

    gen = torch.Generator().manual_seed(0)
    k, sizes = 24, (16, 8, 8)
    slices = (LoraSlice("q_proj", 0, 16), LoraSlice("k_proj", 16, 8), LoraSlice("v_proj", 24, 8))
    targets = LoraTargets(1, {"q_proj": (k, 16), "k_proj": (k, 8), "v_proj": (k, 8)})

    def build(mode: str) -> tuple[nn.Module, LoraModel]:
        torch.manual_seed(1)
        holder = nn.Module()
        holder.qkv = nn.Linear(k, sum(sizes), bias=False).to(DEVICE)
        model = nn.Module()
        model.fused_decode = None
        site = LoraSite(0, holder, "qkv", slices)
        lora = LoraModel(model, targets, [site], mode, lambda *_: None, 4, F32, DEVICE)
        return holder, lora

    def adapter(rank: int, modules: list[str]) -> tuple[AdapterSpec, dict]:
        tensors = {}
        for m in modules:
            fan_in, fan_out = targets.modules[m]
            # (float16 values: the native layer holds its weights as float16)
            tensors[(0, m, "A")] = torch.randn(rank, fan_in, generator=gen).half().float()
            tensors[(0, m, "B")] = torch.randn(fan_out, rank, generator=gen).half().float()
        spec = AdapterSpec(Path("."), rank, 0.5, frozenset(modules), {})
        return spec, tensors

    first, second = adapter(4, ["q_proj", "v_proj"]), adapter(2, ["k_proj", "v_proj", "q_proj"])
    x = torch.randn(6, k, generator=gen).to(DEVICE)
    per_token = np.array([1, 0, 2, 2, 1, 0], dtype=np.uint32)
    outs = []
    for each in (mode, "torch"):
        holder, lora = build(each)
        lora.add(1, *first)
        lora.add(3, *second)
        lora.remove(1)  # its slot goes free and is taken again below
        lora.add(2, *second)
        lora.add(1, *first)
        step = LoraStep.of(per_token, np.arange(7, dtype=np.int32))
        with torch.inference_mode(), lora.step(step):
            outs.append(holder.qkv(x).float().cpu())
    base = build("torch")[0].qkv(x).detach().float().cpu()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[0][[1, 5]], base[[1, 5]])  # base tokens untouched
    assert not torch.allclose(outs[0][0], base[0])
