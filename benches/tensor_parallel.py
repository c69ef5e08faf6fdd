"""Tensor parallelism on the CPU: one rank against two, side by side.

    python benches/tensor_parallel.py [--json FILE]

A Llama-shaped model with random weights (hidden 1024, 16 heads, 4 KV heads,
8 layers, vocabulary 32000; float32), split over --tensor-parallel-size 1
and 2 in turn (engines built and torn down alternately, --repeats rounds):
prefill time of a batch and the median decode step, at batch 1 and 16. On
a 2-core machine the two ranks share the cores each single rank has to
itself, so the figures measure what the collectives cost, not a speed-up;
the path is the one a multi-GPU machine takes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

import ferrox  # noqa: F401  (before torch: see docs/performance.md)
from ferrox.bench.latency import measure
from ferrox.llm import LLM

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
CASES = {"batch 1, 256 in, 32 out": (1, 256, 32), "batch 16, 128 in, 32 out": (16, 128, 32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, dict[int, list[dict[str, float]]]] = {c: {1: [], 2: []} for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIG))
        for repeat in range(args.repeats):
            for tp in (1, 2) if repeat % 2 == 0 else (2, 1):
                llm = LLM(tmp, load_format="dummy", tensor_parallel_size=tp, max_model_len=1024)
                try:
                    for case, (batch, input_len, output_len) in CASES.items():
                        measure(llm.engine, batch, 16, 4, seed=99)  # warm-up
                        results[case][tp].append(
                            measure(llm.engine, batch, input_len, output_len, seed=repeat)
                        )
                finally:
                    llm.engine.close()
    report = {"config": CONFIG, "date": time.strftime("%Y-%m-%d"), "cases": {}}
    print(f"{'case':<28}{'figure':<22}{'TP=1':>14}{'TP=2':>14}{'TP=2 / TP=1':>14}")
    for case, by_tp in results.items():
        entry = {}
        for key, label in (("prefill_s", "prefill ms"), ("decode_step_s", "decode step ms")):
            one = [r[key] * 1e3 for r in by_tp[1]]
            two = [r[key] * 1e3 for r in by_tp[2]]
            ratio = float(np.median(two) / np.median(one))
            entry[key] = {"tp1_ms": one, "tp2_ms": two, "ratio_of_medians": ratio}
            print(
                f"{case:<28}{label:<22}{np.median(one):>8.1f} ({min(one):.0f}-{max(one):.0f})"
                f"{np.median(two):>8.1f} ({min(two):.0f}-{max(two):.0f}){ratio:>10.2f}x"
            )
        report["cases"][case] = entry
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
