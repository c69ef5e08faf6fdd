"""A K-quant file's Q6_K matrices kept in their blocks against the same
values as Q8_0 blocks (what the loader gives them where it does not keep
Q6_K): the block kernel this CPU runs (`FERROX_CPU_ISA=avx2` caps it to the
AVX2 one), a Q4_K_M file's LM head (1024 -> 49152) and an expert's down
projection (256 -> 1024), for 1 to 64 rows. Each weight is held in enough
copies to pass the caches, as a decode step reads it from memory; the two
formats alternate, and each figure is the median (min-max) over the repeats
of microseconds per call. `quant_linear.KERNEL_FORMATS` keeps Q6_K where
these figures favour it.

    python benches/q6_k_blocks.py [--repeats 5] [--rows 1,4,16,64] [--json FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import ferrox  # noqa: F401  # isort: skip  (before torch: ferrox tunes OpenMP)
import numpy as np
import torch

from ferrox._native import cpu_isa, quant_matmul_cpu, quant_matmul_kernel_cpu
from ferrox.layers.native import kernel_threads
from ferrox.layers.quant_linear import BLOCK_BYTES, BLOCK_VALUES, dequantize, pack_blocks, quantize

from machine import spread, write_record  # isort: skip

SHAPES = {"lm_head 1024->49152": (1024, 49152), "expert down 256->1024": (256, 1024)}
STREAMED_BYTES = 300e6  # the copies of a weight a timing cycles through


def q6_k_weight(n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random Q6_K super-blocks: any 6-bit values and signed scales, d about 1e-3."""
    raw = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(n, k // 256, 1)) * 1e-3).astype(np.float16)
    raw[..., 208:] = d.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def time_format(
    weights: list[np.ndarray], fmt: str, x: np.ndarray, out: np.ndarray, threads: int
) -> float:
    """Seconds a call, cycling through the copies once after a warm pass."""
    for w in weights:
        quant_matmul_cpu(out, x, w, None, fmt, threads, True)
    start = time.perf_counter()
    for w in weights:
        quant_matmul_cpu(out, x, w, None, fmt, threads, True)
    return (time.perf_counter() - start) / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    threads = kernel_threads()
    rng = np.random.default_rng(0)
    print(f"kernel {quant_matmul_kernel_cpu()} (ISA {cpu_isa()}), {threads} threads")
    print(f"{'layer':24} {'rows':>4} {'q8_0 us':>24} {'q6_k us':>24} {'q6_k speed-up':>14}")
    result: dict[str, dict[str, dict[str, object]]] = {}
    for name, (k, n) in SHAPES.items():
        q6_k = q6_k_weight(n, k, rng)
        q8_0 = quantize(dequantize(q6_k, "q6_k", k), "q8_0")  # the same values
        copies: dict[str, list[np.ndarray]] = {}
        for fmt, blocks in (("q8_0", q8_0), ("q6_k", q6_k)):
            size = n * k * BLOCK_BYTES[fmt] / BLOCK_VALUES[fmt]
            packed = pack_blocks(blocks, fmt).numpy()
            copies[fmt] = [packed.copy() for _ in range(max(2, int(STREAMED_BYTES / size)))]
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), dtype=np.float32)
            times: dict[str, list[float]] = {"q8_0": [], "q6_k": []}
            for _ in range(args.repeats):
                for fmt in times:
                    times[fmt].append(time_format(copies[fmt], fmt, x, out, threads) * 1e6)
            ratios = [a / b for a, b in zip(times["q8_0"], times["q6_k"], strict=True)]
            print(
                f"{name:24} {m:>4} {spread(times['q8_0']):>24} {spread(times['q6_k']):>24}"
                f" {spread(ratios, 'x', 2):>14}"
            )
            result.setdefault(name, {})[str(m)] = {
                "q8_0_us": times["q8_0"],
                "q6_k_us": times["q6_k"],
                "q6_k_speedup": ratios,
            }
    if args.json:
        write_record(
            args.json,
            kernel=quant_matmul_kernel_cpu(),
            isa=cpu_isa(),
            threads=threads,
            repeats=args.repeats,
            layers=result,
        )


if __name__ == "__main__":
    main()
