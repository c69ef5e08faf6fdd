"""Where the time of a CPU engine step goes, on the first workload of
`offline_throughput.py` (64 requests of 32-256 random prompt tokens).

    python benches/cpu_step_profile.py [--num-requests 64] [--steps 5]

Runs the prefill, then profiles full decode steps and prints, per step, the
time in the native calls: the block (or float) matmuls of the module path
(time, and GOP/s from the model's weight shapes), the paged-attention
kernel, the fused CPU layers (`layers/cpu_decoder.py`: a decode step's
layers, each one call holding its matmuls and attention), and the rest
(Python, torch ops, sampling); the LM head timed alone at the batch size;
and, for scale, how fast the machine reads memory (a 512 MiB sum with
torch's threads).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from ferrox import LLM, SamplingParams  # isort: skip  (before torch: see docs/performance.md)
import numpy as np
import torch

# What the native calls' profile names hold, per kind.
KINDS = {
    "matmuls": ("quant_matmul_cpu", "torch._C._nn.linear"),
    "paged attention": ("paged_attention_cpu",),
    "fused layers": ("CpuDecoderLayer", "CpuGatedDeltaLayer"),
}


def _by_kind(profile: cProfile.Profile, per: int = 1) -> dict[str, float]:
    """Seconds of self time per kind (`KINDS`), divided by `per`."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out = dict.fromkeys(KINDS, 0.0)
    for f, v in stats.items():
        name = pstats.func_std_string(f)
        for kind, marks in KINDS.items():
            if any(m in name for m in marks):
                out[kind] += v[2] / per
    return out


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

    # Linear weights (the LM head apart), by the layers' shapes: a block
    # weight's tensor holds bytes, not weights.
    linears = [m for m in model.layers.modules() if hasattr(m, "out_features")]
    layer_weights = sum(m.in_features * m.out_features for m in linears)
    head = model.lm_head
    vocab, hidden = getattr(head, "out_features", None), getattr(head, "in_features", None)
    if vocab is None or hidden is None:
        vocab, hidden = head.weight.shape

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
    t = _by_kind(profile)
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in t.items() if v)
    print(f"prefill: {prefill_tokens} tokens in {prefill_s:.2f} s ({parts})")
    if t["matmuls"]:
        ops = 2 * layer_weights * prefill_tokens
        print(f"  module-path matmuls at {ops / t['matmuls'] / 1e9:.0f} GOP/s (layers only)")

    seq_lens = [len(p) + 1 for p in prompts]
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    step_s = (time.perf_counter() - start) / args.steps
    t = _by_kind(profile, args.steps)
    batch = args.num_requests
    context = float(np.mean(seq_lens)) + args.steps / 2
    kv_bytes = (
        2 * batch * context * runner.num_layers * runner.num_kv_heads * runner.head_dim
    ) * runner.kv_cache.dtype.itemsize
    mb = kv_bytes / 1e6
    print(f"decode step, batch {batch}: {step_s * 1e3:.1f} ms; reads {mb:.0f} MB of K/V")
    for kind, seconds in t.items():
        if seconds:
            print(f"  {kind:16} {seconds * 1e3:6.1f} ms")
    print(f"  everything else  {(step_s - sum(t.values())) * 1e3:6.1f} ms")
    if t["matmuls"]:  # (the layers' own are in the fused calls when those ran)
        ops = 2 * batch * ((0 if t["fused layers"] else layer_weights) + vocab * hidden)
        print(f"  (matmuls at {ops / t['matmuls'] / 1e9:.0f} GOP/s)")

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
