"""Decode throughput of the bundled model through `LLM.generate`, with the
block kernels' row threshold (`DEQUANTIZE_ABOVE_ROWS`: above it a layer
dequantizes and runs oneDNN's GEMM) set to each given value in turn, in one
process, alternating:

  16 streams  16 prompts of a shared 700-token prefix plus 200 tokens of
              their own (the prefix cache holds them after a warm-up), 64
              greedy tokens each: output tok/s
  1 stream    a 256-token prompt, 128 greedy tokens: tok/s

    python benches/decode_streams.py [--rows 32 8] [--repeats 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import ferrox  # noqa: F401  (before torch: see docs/performance.md)
from ferrox import LLM, SamplingParams
from ferrox.layers import quant_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 8])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shared = rng.integers(100, 40000, size=700).tolist()
    prompts = [shared + rng.integers(100, 40000, size=200).tolist() for _ in range(16)]
    llm = LLM(max_num_seqs=16)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    streams = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    single = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    results: dict[int, tuple[list[float], list[float]]] = {r: ([], []) for r in args.rows}
    for repeat in range(args.repeats):
        for rows in args.rows:
            quant_linear.DEQUANTIZE_ABOVE_ROWS = rows
            start = time.perf_counter()
            llm.generate(prompts, streams, use_tqdm=False)
            many = 16 * 64 / (time.perf_counter() - start)
            start = time.perf_counter()
            llm.generate([prompts[0][:256]], single, use_tqdm=False)
            one = 128 / (time.perf_counter() - start)
            results[rows][0].append(many)
            results[rows][1].append(one)
            print(f"repeat {repeat + 1}, rows {rows}: 16 streams {many:.1f}, 1 stream {one:.1f}")
    print(f"\n{'DEQUANTIZE_ABOVE_ROWS':>22} {'16 streams, median (min-max)':>30} {'1 stream':>24}")
    for rows, (many, one) in results.items():
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in (many, one)]
        print(f"{rows:>22} {cells[0]:>30} {cells[1]:>24}")


if __name__ == "__main__":
    main()
