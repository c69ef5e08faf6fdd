"""Data-parallel routing: prefix-aware against round robin, side by side.

    python benches/dp_routing.py [--json FILE]

`ferrox serve --data-parallel-size 2` on the bundled model (two engine
replicas placed by a local Ray), once with `--data-parallel-routing prefix`
and once with `round_robin`, alternating for --repeats rounds. Each run sends
the `chat` archetype of `ferrox bench serve` with 4 distinct system prompts
(conversations take them in turn; 2 turns each) and reports the prefix-cache
hit rate over both replicas (hit tokens / looked-up tokens, from /metrics)
and TTFT p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ferrox.bench import serve as bench

sys.path.insert(0, str(Path(__file__).parent))
from side_by_side import free_port, start, stop


def prefix_counts(port: int) -> tuple[float, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("ferrox:prefix_cache_hits_total{"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("ferrox:prefix_cache_queries_total{"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def run(routing: str, args: argparse.Namespace, logs: Path, seed: int) -> dict[str, Any]:
    port = free_port()
    command = [
        sys.executable, "-m", "ferrox", "serve", "--port", str(port),
        "--data-parallel-size", str(args.data_parallel_size),
        "--data-parallel-routing", routing,
    ]  # fmt: skip
    proc = start(command, port, logs / f"{routing}-{seed}.log")
    try:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        bargs = parser.parse_args(
            [
                "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "chat",
                "--endpoint", "chat", "--max-concurrency", str(args.concurrency),
                "--num-prompts", str(args.num_prompts), "--seed", str(seed),
                "--chat-num-system-prompts", "4",
                "--chat-system-prompt-len", str(args.system_len), "--chat-num-turns", "2",
                "--chat-user-len", "60", "--chat-output-len-min", str(args.output_len),
                "--chat-output-len-max", str(args.output_len), "--ignore-eos",
                "--percentile-metrics", "ttft", "--metric-percentiles", "50,99",
                "--disable-tqdm",
            ]
        )  # fmt: skip
        bench.apply_presets(bargs)
        report = asyncio.run(bench.run_once(bargs, bench.load_tokenizer(None), float("inf")))
        hits, queries = prefix_counts(port)
    finally:
        stop(proc)
    return {
        "completed": report["completed"],
        "failed": report["failed"],
        "hit_rate": hits / max(queries, 1.0),
        "ttft_p50_ms": report["p50_ttft_ms"],
        "ttft_p99_ms": report["p99_ttft_ms"],
        "output_throughput": report["output_throughput"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=500)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"prefix": [], "round_robin": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ("prefix", "round_robin") if repeat % 2 == 0 else ("round_robin", "prefix")
            for routing in order:
                results[routing].append(run(routing, args, Path(tmp), seed=repeat))
                print(routing, results[routing][-1], flush=True)
    print(f"\n{'figure':<24}{'prefix':>26}{'round robin':>26}{'ratio':>9}")
    for key, label, digits in (
        ("hit_rate", "prefix-cache hit rate", 3),
        ("ttft_p50_ms", "TTFT p50, ms", 0),
        ("ttft_p99_ms", "TTFT p99, ms", 0),
        ("output_throughput", "output tok/s", 1),
    ):
        a = [r[key] for r in results["prefix"]]
        b = [r[key] for r in results["round_robin"]]

        def cell(v: list[float], digits: int = digits) -> str:
            med, lo, hi = statistics.median(v), min(v), max(v)
            return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"

        ratio = statistics.median(a) / max(statistics.median(b), 1e-9)
        print(f"{label:<24}{cell(a):>26}{cell(b):>26}{ratio:>8.2f}x")
    failed = sum(r["failed"] for rs in results.values() for r in rs)
    print(f"failed requests: {failed}")
    if args.json:
        out = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "results": results}
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
