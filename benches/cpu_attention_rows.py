"""CPU attention for prefill rows behind a computed context: the paged kernel
against matrix-multiply attention over the gathered context.

    python benches/cpu_attention_rows.py                  # SmolLM2's heads
    python benches/cpu_attention_rows.py --heads 32 --kv-heads 8 --head-dim 64

A step of `--rows` rows, each `q` new query tokens after `ctx` tokens already
in the paged cache (a prompt's tail behind a prefix-cache hit, a later chunk),
through `CpuAttentionBackend.forward` with every row sent to the paged kernel
and then to the matrix-multiply path. Prints the time of one call (median of
`--repeats`) and matmul / paged for each (q, ctx): where the ratio falls below
1 the matrix-multiply path wins; `SHORT_QUERY_LEN_AFTER_CONTEXT` in
`layers/attention/cpu_backend.py` sits below that point (no limit since the
paged kernel's tile loops: it won at every cell measured).
"""

from __future__ import annotations

import argparse
import statistics
import time

import ferrox  # noqa: F401 (before torch: ferrox tunes OpenMP for its CPU kernels)

# isort: split
import numpy as np
import torch

from ferrox.layers.attention import cpu_backend
from ferrox.layers.attention.base import AttentionMetadata
from ferrox.layers.attention.cpu_backend import CpuAttentionBackend
from machine import cpu_description, write_record

BLOCK = 16


def step(
    rows: int,
    q: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    shared: bool,
) -> tuple:
    """`shared`: every row's context is the same blocks (one cached prefix,
    as after a prefix-cache hit), else each row's own."""
    seq = ctx + q
    width = -(-seq // BLOCK)
    table = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    if shared:
        table[:, : ctx // BLOCK] = table[0, : ctx // BLOCK]
    slots = np.concatenate(
        [
            table[r, p // BLOCK] * BLOCK + p % BLOCK
            for r in range(rows)
            for p in [np.arange(ctx, seq)]
        ]
    )
    starts = np.arange(rows + 1, dtype=np.int32) * q
    seq_lens = np.full(rows, seq, dtype=np.int32)
    meta = AttentionMetadata(
        num_reqs=rows,
        num_decodes=0,
        num_tokens=rows * q,
        slot_mapping=torch.from_numpy(slots.astype(np.int64)),
        block_table=torch.from_numpy(table),
        query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        num_computed_cpu=np.full(rows, ctx, dtype=np.int32),
        max_query_len=q,
        max_seq_len=seq,
        block_table_cpu=table,
    )
    g = torch.Generator().manual_seed(0)
    shape = (rows * width, BLOCK, kv_heads, dim)
    caches = (
        torch.randn(shape, generator=g).to(dtype),
        torch.randn(shape, generator=g).to(dtype),
    )
    qkv = (
        torch.randn(rows * q, heads, dim, generator=g),
        torch.randn(rows * q, kv_heads, dim, generator=g),
        torch.randn(rows * q, kv_heads, dim, generator=g),
    )
    return meta, caches, qkv


def timed(backend: CpuAttentionBackend, args: tuple, limit: int, repeats: int) -> float:
    meta, (kc, vc), (q, k, v) = args
    cpu_backend.PAGED_FRESH_QUERY_LEN = cpu_backend.SHORT_QUERY_LEN_AFTER_CONTEXT = limit
    meta._row_split = None
    backend.forward(q, k, v, kc, vc, meta)  # warm up
    times = []
    for _ in range(repeats):
        meta._row_split = None
        start = time.perf_counter()
        backend.forward(q, k, v, kc, vc, meta)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--queries", default="18,32,48,64,96,128,256")
    parser.add_argument("--contexts", default="64,256,1024,4096")
    parser.add_argument(
        "--own-contexts", action="store_true", help="each row its own context blocks"
    )
    parser.add_argument("--kv-dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    backend = CpuAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    print(f"CPU: {cpu_description()}, paged kernel threads: {backend.num_threads}")
    print(
        f"{args.rows} rows, {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, "
        f"{args.kv_dtype} cache, {'own' if args.own_contexts else 'one shared'} context; "
        "one call, ms: paged kernel | matmul attention | matmul / paged"
    )
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = getattr(torch, args.kv_dtype)
    print("q \\ ctx " + "".join(f"{c:>24}" for c in contexts))
    results: dict[str, dict[str, float]] = {}
    for q in (int(x) for x in args.queries.split(",")):
        cells = []
        for ctx in contexts:
            s = step(
                args.rows,
                q,
                ctx,
                args.heads,
                args.kv_heads,
                args.head_dim,
                dtype,
                not args.own_contexts,
            )
            paged = timed(backend, s, q, args.repeats)
            matmul = timed(backend, s, 0, args.repeats)
            cells.append(f"{paged * 1e3:7.2f} |{matmul * 1e3:7.2f} |{matmul / paged:5.2f}")
            results[f"q={q}, ctx={ctx}"] = {
                "paged_ms": paged * 1e3,
                "matmul_ms": matmul * 1e3,
                "matmul_over_paged": matmul / paged,
            }
        print(f"{q:>7} " + "".join(f"{c:>24}" for c in cells))
    if args.json:
        write_record(args.json, config=vars(args), results=results)


if __name__ == "__main__":
    main()
