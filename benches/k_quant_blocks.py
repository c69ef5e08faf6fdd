"""A K-quant file's matrices kept in their blocks against the same values in
the block format the loader gives them where it does not keep them: Q6_K
against Q8_0 (`--format q6_k`: a Q4_K_M file's LM head, 1024 -> 49152, and
an expert's down projection, 256 -> 1024), Q4_K against Q4_1 (`--format
q4_k`, whose scales Q4_1 rounds to float16: the attention and expert shapes
of `benches/make_bench_gguf.py`'s MoE model and a Llama-3-8B MLP's gate/up),
on the block kernel this CPU runs (`FERROX_CPU_ISA=avx2` caps it to the
AVX2 one), for 1 to 64 rows. Each weight is held in enough copies to pass
the caches, as a decode step reads it from memory; the two formats
alternate, and each figure is the median (min-max) over the repeats of
microseconds per call. `quant_linear.CPU_FORMATS` and `STORED_FORMATS` keep
the K-quants where these figures favour them.

    python benches/k_quant_blocks.py [--format q6_k] [--repeats 5] [--rows 1,4,16,64] [--json FILE]
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
from ferrox.loader.gguf_dequant import q4_k_as_q4_1

from machine import spread, write_record  # isort: skip

# (K, N) of each format's matrices
SHAPES = {
    "q6_k": {"lm_head 1024->49152": (1024, 49152), "expert down 256->1024": (256, 1024)},
    "q4_k": {
        "q/k 1024->2560": (1024, 2560),
        "o 2048->1024": (2048, 1024),
        "expert gate_up 1024->512": (1024, 512),
        "8B gate_up 4096->28672": (4096, 28672),
    },
}
STREAMED_BYTES = 300e6  # the copies of a weight a timing cycles through


def q6_k_weight(n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random Q6_K super-blocks: any 6-bit values and signed scales, d about 1e-3."""
    raw = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(n, k // 256, 1)) * 1e-3).astype(np.float16)
    raw[..., 208:] = d.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def q4_k_weight(n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random Q4_K super-blocks: any 6-bit scales and mins and nibbles, d and
    dmin about 1e-3."""
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(n, k // 256, 2)) * 1e-3).astype(np.float16)
    raw[..., :4] = d.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """{the format the loader would give it: the values in it, fmt: the K-quant}."""
    if fmt == "q6_k":
        q6_k = q6_k_weight(n, k, rng)
        return {"q8_0": quantize(dequantize(q6_k, "q6_k", k), "q8_0"), "q6_k": q6_k}
    q4_k = q4_k_weight(n, k, rng)
    return {"q4_1": torch.from_numpy(q4_k_as_q4_1(q4_k.numpy()).reshape(n, -1)), "q4_k": q4_k}


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
    parser.add_argument("--format", choices=sorted(SHAPES), default="q6_k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    threads = kernel_threads()
    rng = np.random.default_rng(0)
    kept = args.format
    print(f"kernel {quant_matmul_kernel_cpu()} (ISA {cpu_isa()}), {threads} threads")
    result: dict[str, dict[str, dict[str, object]]] = {}
    for name, (k, n) in SHAPES[kept].items():
        blocks = weights(kept, n, k, rng)
        other = next(fmt for fmt in blocks if fmt != kept)
        if not result:
            columns = f"{other + ' us':>24} {kept + ' us':>24} {kept + ' speed-up':>14}"
            print(f"{'layer':26} {'rows':>4} {columns}")
        copies: dict[str, list[np.ndarray]] = {}
        for fmt, values in blocks.items():
            size = n * k * BLOCK_BYTES[fmt] / BLOCK_VALUES[fmt]
            packed = pack_blocks(values, fmt).numpy()
            copies[fmt] = [packed.copy() for _ in range(max(2, int(STREAMED_BYTES / size)))]
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), dtype=np.float32)
            times: dict[str, list[float]] = {other: [], kept: []}
            for _ in range(args.repeats):
                for fmt in times:
                    times[fmt].append(time_format(copies[fmt], fmt, x, out, threads) * 1e6)
            ratios = [a / b for a, b in zip(times[other], times[kept], strict=True)]
            print(
                f"{name:26} {m:>4} {spread(times[other]):>24} {spread(times[kept]):>24}"
                f" {spread(ratios, 'x', 2):>14}"
            )
            result.setdefault(name, {})[str(m)] = {
                f"{other}_us": times[other],
                f"{kept}_us": times[kept],
                f"{kept}_speedup": ratios,
            }
        del copies
    if args.json:
        write_record(
            args.json,
            kernel=quant_matmul_kernel_cpu(),
            isa=cpu_isa(),
            threads=threads,
            repeats=args.repeats,
            format=kept,
            layers=result,
        )


if __name__ == "__main__":
    main()
