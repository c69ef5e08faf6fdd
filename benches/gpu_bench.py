"""GPU benchmarks with random weights (load_format="dummy"), for a machine
with an NVIDIA GPU; called by benches/gpu_check.sh. Each part is time-boxed.

(a) Llama-3-8B-shaped model, bf16: batch-1 decode step time against the
    memory floor (weight bytes / the device copy bandwidth measured here).
(b) 256 requests of 512 random prompt tokens and 256 output tokens: ferrox
    against transformers `generate` (static batches) on the same device.
(c) CUDA graphs on against off: decode step time at batch 1 and 64.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
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


def copy_bandwidth(device: torch.device, num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    return 2 * num_bytes / seconds


def decode_step_time(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    """Median seconds of a decode-only step with `batch` running requests."""
    engine = llm.engine
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"d{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(0, 32000, prompt_len).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill until every request has its first token
        started.update(d.request_id for d in engine.step()[0] if d.token_ids)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return float(np.median(times))


def part_a_and_c(model_dir: str, out: dict[str, Any], deadline: float) -> LLM:
    llm = LLM(
        model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256
    )
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    bandwidth = copy_bandwidth(torch.device("cuda"))
    floor = weights / bandwidth
    step = decode_step_time(llm, 1, 512, 64)
    out["a"] = {
        "weight_bytes": weights,
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
    runner = llm.engine.runner
    graphs = runner.graphs
    out["c"] = {}
    for batch in (1, 64):
        if time.monotonic() > deadline:
            break
        on = decode_step_time(llm, batch, 512, 32, seed=batch)
        runner.graphs = None
        off = decode_step_time(llm, batch, 512, 32, seed=batch + 1)
        runner.graphs = graphs
        out["c"][f"batch_{batch}"] = {
            "graphs_ms": on * 1e3,
            "eager_ms": off * 1e3,
            "speedup": off / on,
        }
        print(f"(c) batch {batch}: graphs {on * 1e3:.2f} ms, eager {off * 1e3:.2f} ms "
              f"({off / on:.2f}x)", flush=True)  # fmt: skip
    return llm


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 32000, prompt_len).tolist() for _ in range(n)]


def part_b(llm: LLM, model_dir: str, out: dict[str, Any], args: argparse.Namespace) -> None:
    prompts = workload(args.num_requests, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    print(f"(b) ferrox: {ours:.0f} output tok/s", flush=True)
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k != "architectures"})
    with torch.device("cuda"):
        hf = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    produced, start = 0, time.perf_counter()
    box = time.monotonic() + args.hf_seconds
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            ids = torch.tensor(prompts[i : i + args.hf_batch_size], device="cuda")
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
    out["b"] = {
        "ferrox_tok_s": ours,
        "transformers_tok_s": theirs,
        "ratio": ours / theirs,
        "target": 10.0,
        "transformers_requests_run": produced // args.output_len,
    }
    print(
        f"(b) transformers generate: {theirs:.0f} tok/s -> ratio {ours / theirs:.1f}x", flush=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-seconds", type=float, default=90.0, help="time box of transformers")
    parser.add_argument("--budget-seconds", type=float, default=420.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_seconds
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_8B))
        llm = part_a_and_c(tmp, out, deadline)
        if time.monotonic() < deadline - 120:
            part_b(llm, tmp, out, args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
