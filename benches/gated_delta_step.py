"""The gated delta rule's CPU decode step alone (`gated_delta_decode_cpu`,
what a Qwen3.5-style linear-attention layer does per token after its
projections): one row, 16 value heads of 128 x 128, microseconds per call,
over a state pool of `--slots` sequences' slots (each 1 MiB in float32)
taken in turn, so that a pool larger than the last-level cache is read
from memory as a decode step reads it, and a small one from the cache.
The pool's dtypes and the thread counts take turns, repeat by repeat.

    python benches/gated_delta_step.py [--slots 2,72] [--threads 1,2]
        [--dtypes float32,bfloat16] [--repeats 7] [--json FILE]

`--dtypes float32` alone runs on builds whose kernel takes no bfloat16
pool (an older revision's package on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import sys
import time

import ferrox  # noqa: F401  # isort: skip  (before torch)
import numpy as np
import torch

from ferrox._native import gated_delta_decode_cpu

from machine import cpu_description, spread, write_record  # isort: skip

HEADS, DIM = 16, 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", default="2,72", help="pool sizes, in slots of 1 MiB")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, HEADS, DIM), dtype=np.float32) * 0.1 for _ in range(2))
    v = rng.standard_normal((1, HEADS, DIM), dtype=np.float32)
    g = np.full((1, HEADS), -0.1, np.float32)
    beta = np.full((1, HEADS), 0.5, np.float32)
    out = np.zeros((1, HEADS, DIM), np.float32)
    fresh = np.array([False])
    results: dict[str, list[float]] = {}
    for slots in (int(s) for s in args.slots.split(",")):
        pools = {}
        for name in args.dtypes.split(","):
            pool = torch.randn(slots, HEADS, DIM, DIM) * 0.01
            pool = pool.to(getattr(torch, name))
            pools[name] = pool.view(torch.int16).numpy() if name == "bfloat16" else pool.numpy()
        for _ in range(args.repeats):
            for threads in (int(t) for t in args.threads.split(",")):
                for name, array in pools.items():
                    start = time.perf_counter()
                    for s in range(slots):
                        gated_delta_decode_cpu(
                            array, np.array([s]), fresh, q, k, v, g, beta, out, threads
                        )
                    per_call = (time.perf_counter() - start) / slots * 1e6
                    results.setdefault(f"{slots} slots, {threads} threads, {name}", []).append(
                        per_call
                    )
    print(f"CPU: {cpu_description()}")
    for key, times in results.items():
        print(f"{key:>38}: {spread(times)} us a call")
    if args.json:
        write_record(args.json, heads=HEADS, dim=DIM, us_per_call=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
