"""GPU benchmarks with random weights (load_format="dummy"), for a machine
with an NVIDIA GPU; called by benches/gpu_check.sh. The run has one deadline
(--budget-seconds); every part checks it before it starts, and the JSON is
written after every part and on any error, so a late failure loses nothing.

(a) Llama-3-8B-shaped model, bf16: batch-1 decode step time against the
    memory floor (the bytes one decode step reads: every weight but the
    input embedding table, plus the context's KV cache, over the device's
    copy bandwidth measured here).
(c) CUDA graphs on against off: decode step time at batch 1 and 64.
(d) The Triton dequantize-GEMM (q4_1, q8_0 blocks; triton_kernels/quant_matmul.py)
    against torch's bf16 matmul on the same shapes (Llama-3-8B projections),
    1, 16 and 256 rows: median ms and the ratio.
(b) 256 requests of 512 random prompt tokens and 256 output tokens: ferrox
    against transformers `generate` (static batches, bf16, SDPA attention)
    on the same device; the ferrox engine is freed before transformers'
    model is built.

--dry-run runs the same parts on a tiny model on the CPU, with few requests:
it checks the script's paths, not speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferrox import LLM, SamplingParams

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
TINY = {
    **LLAMA3_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}
HF_ATTENTION = "sdpa"  # transformers' attention implementation in part (b)
WARMUP_STEPS = 3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    synchronize(device)
    seconds = (time.perf_counter() - start) / 10
    del src, dst
    return 2 * num_bytes / seconds


def decode_bytes(llm: LLM, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight except the input
    embedding table (one row of it is read per token; tied, it is also the
    output layer and counts), plus the KV cache of `batch` contexts."""
    model = llm.engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.tie_word_embeddings:
        table = model.embed_tokens.weight
        weights -= table.numel() * table.element_size()
    runner = llm.engine.runner
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    kv = batch * context * runner.num_layers * 2 * runner.num_kv_heads * runner.head_dim * itemsize
    return weights + kv


def decode_step_time(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    """Median seconds of a decode-only step with `batch` running requests,
    after WARMUP_STEPS untimed ones."""
    engine = llm.engine
    device = engine.runner.device
    vocab = engine.runner.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + WARMUP_STEPS + 8, ignore_eos=True)
    ids = [f"d{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(0, vocab, prompt_len).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill until every request has its first token
        started.update(d.request_id for d in engine.step()[0] if d.token_ids)
    for _ in range(WARMUP_STEPS):
        engine.step()
    times = []
    for _ in range(steps):
        synchronize(device)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return float(np.median(times))


def part_a(llm: LLM, out: dict[str, Any], args: argparse.Namespace) -> None:
    device = llm.engine.runner.device
    read = decode_bytes(llm, 1, args.prompt_len)
    bandwidth = copy_bandwidth(device, args.copy_bytes)
    floor = read / bandwidth
    step = decode_step_time(llm, 1, args.prompt_len, args.decode_steps)
    out["a"] = {
        "bytes_read_per_step": read,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor * 1e3,
        "decode_step_ms": step * 1e3,
        "fraction_of_floor_speed": floor / step,
        "target": 0.8,
    }
    print(
        f"(a) batch-1 decode {step * 1e3:.2f} ms vs floor {floor * 1e3:.2f} ms "
        f"({floor / step:.0%} of floor speed; copy bandwidth {bandwidth / 1e9:.0f} GB/s)",
        flush=True,
    )


def part_c(llm: LLM, out: dict[str, Any], args: argparse.Namespace, deadline: float) -> None:
    runner = llm.engine.runner
    graphs = runner.graphs
    out["c"] = {"graphs_captured": graphs is not None}
    for batch in (1, 64):
        if time.monotonic() > deadline:
            break
        on = decode_step_time(llm, batch, args.prompt_len, args.decode_steps // 2, seed=batch)
        runner.graphs = None
        try:
            off = decode_step_time(
                llm, batch, args.prompt_len, args.decode_steps // 2, seed=batch + 1
            )
        finally:
            runner.graphs = graphs
        out["c"][f"batch_{batch}"] = {
            "graphs_ms": on * 1e3,
            "eager_ms": off * 1e3,
            "speedup": off / on,
        }
        print(f"(c) batch {batch}: graphs {on * 1e3:.2f} ms, eager {off * 1e3:.2f} ms "
              f"({off / on:.2f}x)", flush=True)  # fmt: skip


def cuda_ms(fn: Any, repeats: int = 20) -> float:
    """Median milliseconds of `fn()` on the GPU, by CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def part_d(out: dict[str, Any], args: argparse.Namespace, deadline: float) -> None:
    if args.dry_run:
        out["d"] = {"skipped": "needs a GPU"}
        return
    from ferrox.layers.quant_linear import quantize
    from ferrox.triton_kernels.quant_matmul import dequant_matmul, split_blocks

    out["d"] = {}
    for n, k in ((4096, 4096), (14336, 4096)):
        weight = torch.randn(n, k) * 0.02
        dense = weight.to("cuda", torch.bfloat16)
        for fmt in ("q4_1", "q8_0"):
            split = split_blocks(quantize(weight, fmt).cuda(), fmt, k)
            for m in (1, 16, 256):
                if time.monotonic() > deadline:
                    return
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ours = cuda_ms(lambda x=x, split=split: dequant_matmul(x, split))
                torch_ms = cuda_ms(lambda x=x, w=dense: torch.nn.functional.linear(x, w))
                key = f"{fmt}_{n}x{k}_m{m}"
                out["d"][key] = {"triton_ms": ours, "bf16_ms": torch_ms, "speedup": torch_ms / ours}
                print(f"(d) {key}: dequant-GEMM {ours:.3f} ms, bf16 {torch_ms:.3f} ms "
                      f"({torch_ms / ours:.2f}x)", flush=True)  # fmt: skip


def workload(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, prompt_len).tolist() for _ in range(n)]


def part_b_ferrox(
    llm: LLM, prompts: list[list[int]], out: dict[str, Any], args: argparse.Namespace
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    out["b"] = {"ferrox_tok_s": ours, "num_requests": len(prompts), "target": 10.0}
    print(f"(b) ferrox: {ours:.0f} output tok/s", flush=True)


def part_b_transformers(
    config_dict: dict[str, Any],
    prompts: list[list[int]],
    device: torch.device,
    out: dict[str, Any],
    args: argparse.Namespace,
    deadline: float,
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    options = {k: v for k, v in config_dict.items() if k not in ("architectures", "torch_dtype")}
    config = LlamaConfig(**options)
    config._attn_implementation = HF_ATTENTION
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy first
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    produced, start = 0, time.perf_counter()
    box = min(time.monotonic() + args.hf_seconds, deadline)
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            ids = torch.tensor(prompts[i : i + args.hf_batch_size], device=device)
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
            produced += (gen.shape[1] - ids.shape[1]) * ids.shape[0]
            if time.monotonic() > box:
                break  # static batches all take the same time: the rate is known
    theirs = produced / (time.perf_counter() - start)
    ours = out["b"]["ferrox_tok_s"]
    out["b"].update(
        transformers_tok_s=theirs,
        transformers_attention=HF_ATTENTION,
        transformers_dtype=str(dtype).removeprefix("torch."),
        transformers_requests_run=produced // args.output_len,
        ratio=ours / theirs,
    )
    print(
        f"(b) transformers generate ({HF_ATTENTION}): {theirs:.0f} tok/s "
        f"-> ratio {ours / theirs:.1f}x",
        flush=True,
    )


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, out: dict[str, Any], save: Any) -> None:
    deadline = time.monotonic() + args.budget_seconds
    config_dict = TINY if args.dry_run else LLAMA3_8B
    device = torch.device("cpu" if args.dry_run else "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_dict))
        llm = LLM(
            tmp,
            load_format="dummy",
            device=device.type,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            max_model_len=4096 if not args.dry_run else 1024,
            max_num_seqs=256 if not args.dry_run else 64,
        )
        out["engine_ready_s"] = args.budget_seconds - (deadline - time.monotonic())
        part_a(llm, out, args)
        save()
        part_c(llm, out, args, deadline)
        save()
        part_d(out, args, deadline)
        save()
        prompts = workload(args.num_requests, args.prompt_len, int(config_dict["vocab_size"]))
        if time.monotonic() > deadline - args.part_b_seconds:
            out["b"] = {"skipped": "not enough time left in the budget"}
            return
        part_b_ferrox(llm, prompts, out, args)
        save()
        del llm
        free_device_memory(device)
        if time.monotonic() > deadline - 30:
            out["b"]["transformers"] = "skipped: not enough time left in the budget"
            return
        part_b_transformers(config_dict, prompts, device, out, args, deadline)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--copy-bytes", type=int, default=4 << 30)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-seconds", type=float, default=90.0, help="time box of transformers")
    parser.add_argument(
        "--part-b-seconds", type=float, default=150.0, help="budget left below which (b) is skipped"
    )
    parser.add_argument("--budget-seconds", type=float, default=400.0)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args()
    if args.dry_run:
        args.num_requests, args.prompt_len, args.output_len = 8, 32, 8
        args.decode_steps, args.copy_bytes, args.part_b_seconds = 4, 1 << 20, 0.0
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if not args.dry_run else "cpu (dry run)",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
    }

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2))

    try:
        run(args, out, save)
    except BaseException:
        out["error"] = traceback.format_exc()
        raise
    finally:
        save()
        if args.out:
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
