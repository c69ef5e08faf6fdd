"""Decode attention on the CPU: a step's decode rows through the paged kernel,
behind one shared prefix (a chat's system prompt, an agent's fan-out) or
each behind a context of its own, over as many layers' caches as a model
has (so each call finds its blocks in memory, not in the caches of the
last call).

    python benches/decode_attention.py                 # SmolLM2's heads, 30 layers
    FERROX_CPU_ISA=avx2 python benches/decode_attention.py --threads 1,2

Per layout and thread count: the median time of one step (every layer's
call, `--repeats` steps), its multiply-adds per second (scores and values:
2 x heads x head size x context per row and layer), and how much faster
the shared layout runs than the own one (the shared blocks are read, and a
float16 block widened, once for up to eight rows: `QUERY_TILE`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from ferrox._native import paged_attention_cpu
from machine import cpu_description, spread, write_record

BLOCK = 16


def caches(
    rng: np.random.Generator, layers: int, blocks: int, kv_heads: int, head_dim: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Float16 K/V pools (as int16 views, what the kernel takes) per layer."""
    shape = (blocks, BLOCK, kv_heads, head_dim)
    return [
        tuple(rng.standard_normal(shape).astype(np.float16).view(np.int16) for _ in "kv")  # type: ignore[misc]
        for _ in range(layers)
    ]


def tables(rows: int, prefix: int, own: int, shared: bool) -> np.ndarray:
    """Block tables: `prefix` blocks shared by every row (or each row's own
    copy), then `own` blocks of each row's."""
    width = prefix + own
    table = np.zeros((rows, width), np.int32)
    next_block = prefix if shared else 0
    for r in range(rows):
        if shared:
            table[r, :prefix] = np.arange(prefix)
        else:
            table[r, :prefix] = next_block + np.arange(prefix)
            next_block += prefix
        table[r, prefix:] = next_block + np.arange(own)
        next_block += own
    return table


def step_times(args: argparse.Namespace, shared: bool, threads: int) -> tuple[float, float]:
    """(median seconds of one step, multiply-adds of one step)."""
    rng = np.random.default_rng(0)
    prefix, own = args.prefix // BLOCK, -(-args.own // BLOCK)
    table = tables(args.rows, prefix, own, shared)
    pools = caches(rng, args.layers, int(table.max()) + 1, args.kv_heads, args.head_dim)
    context = args.prefix + args.own
    q = rng.standard_normal((args.rows, args.heads, args.head_dim)).astype(np.float32)
    out = np.empty_like(q)
    starts = np.arange(args.rows + 1, dtype=np.int32)
    seq_lens = np.full(args.rows, context, np.int32)
    rows = np.arange(args.rows, dtype=np.int32)
    scale = args.head_dim**-0.5

    def one_step() -> None:
        for k, v in pools:
            paged_attention_cpu(out, q, k, v, table, starts, seq_lens, rows, scale, threads)

    one_step()  # warm up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    macs = 2 * args.rows * args.heads * args.head_dim * context * args.layers
    return statistics.median(times), macs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prefix", type=int, default=704, help="tokens, a multiple of 16")
    parser.add_argument("--own", type=int, default=124, help="each row's own tokens after it")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the layouts")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.prefix % BLOCK:
        parser.error(f"--prefix must be a multiple of {BLOCK}")
    print(f"CPU: {cpu_description()}")
    print(
        f"{args.rows} decode rows, {args.heads} heads / {args.kv_heads} KV heads of "
        f"{args.head_dim}, float16 cache, {args.prefix} prefix + {args.own} own tokens, "
        f"{args.layers} layers; one step, median of {args.repeats}, over {args.rounds} rounds"
    )
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for threads in (int(t) for t in args.threads.split(",")):
            for layout in ("shared", "own"):
                seconds, macs = step_times(args, layout == "shared", threads)
                cell = results.setdefault(f"{layout}, {threads} threads", {"ms": [], "gmacs": []})
                cell["ms"].append(seconds * 1e3)
                cell["gmacs"].append(macs / seconds / 1e9)
    for name, cell in results.items():
        print(f"{name:>20}: {spread(cell['ms'], ' ms', 2)}, {spread(cell['gmacs'], ' GMAC/s')}")
    for threads in (int(t) for t in args.threads.split(",")):
        own, shared = results[f"own, {threads} threads"], results[f"shared, {threads} threads"]
        ratios = [o / s for o, s in zip(own["ms"], shared["ms"], strict=True)]
        print(f"{threads} threads: shared prefix {spread(ratios, 'x', 2)} faster than own contexts")
    if args.json:
        write_record(args.json, config=vars(args), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
