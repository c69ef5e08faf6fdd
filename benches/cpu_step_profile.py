"""Where the time of a CPU engine step goes, on the first workload of
`offline_throughput.py` (64 requests of 32-256 random prompt tokens).

    python benches/cpu_step_profile.py [--num-requests 64] [--steps 5]

Runs the prefill, then profiles full decode steps and prints, per step:
matrix multiplies (time and GFLOP/s from the model's weight shapes), the
paged-attention kernel (time, and the GB/s of K and V it reads), the rest;
the LM head timed alone at the batch size; and, for scale, how fast the
machine reads memory (a 512 MiB sum with torch's threads).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from ferrox import LLM, SamplingParams  # isort: skip  (before torch: see docs/performance.md)
import numpy as np
import torch

LINEAR = "{built-in method torch._C._nn.linear}"
ATTENTION = "{built-in method ferrox._native.paged_attention_cpu}"


def _self_seconds(profile: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {pstats.func_std_string(f): v[2] for f, v in stats.items()}


def _timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(max_num_seqs=args.num_requests)
    engine = llm.engine
    model = engine.runner.model
    runner = engine.runner
    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(100, 49000, size=int(rng.integers(32, 257))).tolist()
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)

    # Linear weights: every 2-D parameter of the layers (the LM head apart).
    layer_weights = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    vocab, hidden = model.lm_head.weight.shape

    prefill_tokens = sum(len(p) for p in prompts)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    while True:  # until a step samples every request: all prompts are in
        before = engine.num_generated_tokens
        engine.step()
        if engine.num_generated_tokens - before == args.num_requests:
            break
    profile.disable()
    prefill_s = time.perf_counter() - start
    t = _self_seconds(profile)
    prefill_flops = 2 * layer_weights * prefill_tokens
    print(
        f"prefill: {prefill_tokens} tokens in {prefill_s:.2f} s; matmuls {t[LINEAR]:.2f} s "
        f"at {prefill_flops / t[LINEAR] / 1e9:.0f} GFLOP/s (layers only)"
    )

    seq_lens = [len(p) + 1 for p in prompts]
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    step_s = (time.perf_counter() - start) / args.steps
    t = {k: v / args.steps for k, v in _self_seconds(profile).items()}
    batch = args.num_requests
    flops = 2 * batch * (layer_weights + vocab * hidden)
    context = float(np.mean(seq_lens)) + args.steps / 2
    kv_bytes = (
        (2 * batch * context * runner.num_layers * runner.num_kv_heads * runner.head_dim)
        * torch.finfo(runner.dtype).bits
        // 8
    )
    other = step_s - t[LINEAR] - t[ATTENTION]
    print(f"decode step, batch {batch}: {step_s * 1e3:.1f} ms")
    print(f"  matmuls          {t[LINEAR] * 1e3:6.1f} ms  {flops / t[LINEAR] / 1e9:6.0f} GFLOP/s")
    print(
        f"  paged attention  {t[ATTENTION] * 1e3:6.1f} ms  reads {kv_bytes / 1e6:.0f} MB of K/V "
        f"= {kv_bytes / t[ATTENTION] / 1e9:.1f} GB/s"
    )
    print(f"  everything else  {other * 1e3:6.1f} ms")

    x = torch.randn(batch, hidden)
    with torch.inference_mode():
        head_s = _timed(lambda: model.compute_logits(x), 10)
    print(f"  (of the matmuls: the LM head, {vocab} x {hidden}, {head_s * 1e3:.1f} ms)")

    buf = torch.ones(128 * 1024 * 1024)  # 512 MiB
    read_s = _timed(lambda: buf.sum(), 5)
    print(f"memory read bandwidth ({torch.get_num_threads()} threads): "
          f"{buf.numel() * 4 / read_s / 1e9:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
