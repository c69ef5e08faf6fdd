"""Decode attention on the CPU: a step's decode rows through the paged kernel,
behind one shared prefix (a chat's system prompt, an agent's fan-out) or
each behind a context of its own, over as many layers' caches as a model
has (so each call finds its blocks in memory, not in the caches of the
last call).

    python benches/decode_attention.py                 # SmolLM2's heads, 30 layers
    FERROX_CPU_ISA=avx2 python benches/decode_attention.py --threads 1,2
    python benches/decode_attention.py --block-sizes 16,32,64 --threads 2

Per layout, set of loops and thread count: the median time of one step
(every layer's call, `--repeats` steps), its multiply-adds per second
(scores and values: 2 x heads x head size x context per row and layer).
The loops: `tile` (the default: the rows of a tile of up to eight,
`QUERY_TILE`, that read one block take it together, as small matrix
products) against `per-query` (each row as it is alone, what
`batch_invariant` runs), alternating in one process; then how much faster
the tile loops run, and the shared layout than the own one. With several
`--block-sizes` (tokens per KV block, the engine's `block_size`), each
layout is also laid out in blocks of each size, alternating, and the
larger blocks' speed is given against the first size's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from ferrox._native import paged_attention_cpu
from machine import cpu_description, spread, write_record


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


class Step:
    """One step's decode rows and every layer's float16 K/V pool (int16
    views, what the kernel takes), made once per layout and block size."""

    def __init__(self, args: argparse.Namespace, shared: bool, block: int) -> None:
        rng = np.random.default_rng(0)
        self.table = tables(args.rows, args.prefix // block, -(-args.own // block), shared)
        shape = (int(self.table.max()) + 1, block, args.kv_heads, args.head_dim)

        def pool() -> np.ndarray:
            return rng.standard_normal(shape).astype(np.float16).view(np.int16)

        self.pools = [(pool(), pool()) for _ in range(args.layers)]
        context = args.prefix + args.own
        self.q = rng.standard_normal((args.rows, args.heads, args.head_dim)).astype(np.float32)
        self.out = np.empty_like(self.q)
        self.starts = np.arange(args.rows + 1, dtype=np.int32)
        self.seq_lens = np.full(args.rows, context, np.int32)
        self.rows = np.arange(args.rows, dtype=np.int32)
        self.scale = args.head_dim**-0.5
        self.macs = 2 * args.rows * args.heads * args.head_dim * context * args.layers

    def run(self, threads: int, per_query: bool) -> None:
        for k, v in self.pools:
            paged_attention_cpu(
                self.out, self.q, k, v, self.table, self.starts, self.seq_lens, self.rows,
                self.scale, threads, batch_invariant=per_query,
            )  # fmt: skip

    def seconds(self, threads: int, per_query: bool, repeats: int) -> float:
        """The median time of one step (after one to warm up)."""
        self.run(threads, per_query)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.run(threads, per_query)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument(
        "--prefix", type=int, default=704, help="tokens, a multiple of every block size"
    )
    parser.add_argument("--own", type=int, default=124, help="each row's own tokens after it")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--block-sizes", default="16", help="tokens per KV block, e.g. 16,32")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternations of the layouts and loops"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    blocks = [int(b) for b in args.block_sizes.split(",")]
    if any(args.prefix % b for b in blocks):
        parser.error(f"--prefix must be a multiple of every block size ({blocks})")
    print(f"CPU: {cpu_description()}")
    print(
        f"{args.rows} decode rows, {args.heads} heads / {args.kv_heads} KV heads of "
        f"{args.head_dim}, float16 cache, {args.prefix} prefix + {args.own} own tokens, "
        f"{args.layers} layers; one step, median of {args.repeats}, over {args.rounds} rounds"
    )
    layouts = ("shared", "own")
    steps = {(layout, b): Step(args, layout == "shared", b) for layout in layouts for b in blocks}
    thread_counts = [int(t) for t in args.threads.split(",")]
    loops = {"tile": False, "per-query": True}

    def key(layout: str, name: str, threads: int, block: int) -> str:
        sized = f", {block}-token blocks" if len(blocks) > 1 else ""
        return f"{layout}, {name}, {threads} threads{sized}"

    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for threads in thread_counts:
            for (layout, block), step in steps.items():
                for name, per_query in loops.items():
                    seconds = step.seconds(threads, per_query, args.repeats)
                    cell = results.setdefault(
                        key(layout, name, threads, block), {"ms": [], "gmacs": []}
                    )
                    cell["ms"].append(seconds * 1e3)
                    cell["gmacs"].append(step.macs / seconds / 1e9)
    for name, cell in results.items():
        print(f"{name:>46}: {spread(cell['ms'], ' ms', 2)}, {spread(cell['gmacs'], ' GMAC/s')}")

    def ratio(slow: str, fast: str) -> str:
        pairs = zip(results[slow]["ms"], results[fast]["ms"], strict=True)
        return spread([a / b for a, b in pairs], "x", 2)

    for threads in thread_counts:
        for block in blocks:
            at = f"{threads} threads" + (f", {block}-token blocks" if len(blocks) > 1 else "")
            for layout in layouts:
                tile, per_query = (key(layout, n, threads, block) for n in loops)
                print(f"{at}, {layout}: tile loops {ratio(per_query, tile)} faster")
            for name in loops:
                shared, own = (key(layout, name, threads, block) for layout in layouts)
                print(f"{at}, {name}: shared prefix {ratio(own, shared)} faster than own")
        for block in blocks[1:]:
            for layout in layouts:
                for name in loops:
                    first, this = (key(layout, name, threads, b) for b in (blocks[0], block))
                    print(
                        f"{threads} threads, {layout}, {name}: {block}-token blocks "
                        f"{ratio(first, this)} faster than {blocks[0]}-token ones"
                    )
    if args.json:
        write_record(args.json, config=vars(args), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
