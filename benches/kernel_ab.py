"""The block matmul kernels of another git revision against the current
ones: `cargo bench -p ferrox-cpu --bench quant_matmul` built at both, the two
binaries run alternately (one repeat each per round), and per shape and row
count the fastest kernel's GMAC/s of each, median (min-max) over the rounds,
and the ratio per round pair.

    python benches/kernel_ab.py --baseline REF [--rounds 5] [--threads 1]
        [--rows 16,64,256] [--only gate_up] [--json FILE]

Both binaries see the same `FERROX_CPU_ISA`, so a cap applies to both.
Without `--only` a round runs every shape and kernel of the bench, the
K-quant LM head on the pair kernel too: minutes a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import ferrox  # noqa: F401  # isort: skip  (the record's `cpu_isa`)

from baseline import ROOT, add_worktree, remove_baseline  # isort: skip
from machine import spread, write_record  # isort: skip


def build_bench(tree: Path, target: Path) -> Path:
    """The quant_matmul bench binary of the crates in `tree`."""
    out = subprocess.run(
        [
            "cargo",
            "bench",
            "-p",
            "ferrox-cpu",
            "--bench",
            "quant_matmul",
            "--no-run",
            "--message-format",
            "json",
        ],
        cwd=tree,
        env=dict(os.environ, CARGO_TARGET_DIR=str(target)),
        capture_output=True,
        text=True,
        check=True,
    )
    for line in out.stdout.splitlines():
        msg = json.loads(line)
        built = msg.get("reason") == "compiler-artifact" and msg.get("executable")
        if built and msg["target"]["name"] == "quant_matmul":
            return Path(msg["executable"])
    raise SystemExit(f"no quant_matmul bench binary built in {tree}")


def run_once(binary: Path, args: list[str]) -> dict[str, float]:
    """GMAC/s of the fastest kernel per `shape rows` line of one run."""
    out = subprocess.run(
        [str(binary), *args, "--repeats", "1"], capture_output=True, text=True, check=True
    )
    rates = {}
    for line in out.stdout.splitlines():
        words = line.split()
        if len(words) > 4 and words[-1].replace(".", "", 1).isdigit() and words[-2].endswith("x"):
            # "name K->N fmt" then the rows
            rates[" ".join(words[:4])] = float(words[-1])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="16,64,256")
    parser.add_argument("--only", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="ferrox-kernel-ab-")) / "tree"
    add_worktree(args.baseline, folder)
    try:
        before = build_bench(folder, ROOT / "target" / "baseline")
        after = build_bench(ROOT, ROOT / "target")
        bench_args = ["--threads", str(args.threads), "--rows", args.rows]
        if args.only:
            bench_args += ["--only", args.only]
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for round_ in range(args.rounds):
            # alternate which goes first, so neither always gets the warmer minute
            order = [("before", before), ("after", after)]
            for name, binary in order if round_ % 2 == 0 else order[::-1]:
                runs[name].append(run_once(binary, bench_args))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        remove_baseline(folder)

    print(
        f"GMAC/s of the fastest kernel, {args.threads} thread(s), median (min-max) of "
        f"{args.rounds} rounds; after/before per round"
    )
    print(f"{'shape rows':<36}{'before':>22}{'after':>22}{'after/before':>24}")
    figures = {}
    for key in runs["after"][0]:
        b = [r[key] for r in runs["before"]]
        a = [r[key] for r in runs["after"]]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        print(f"{key:<36}{spread(b):>22}{spread(a):>22}{spread(ratios, 'x', 2):>24}")
        figures[key] = {"before": b, "after": a, "ratio_median": statistics.median(ratios)}
    if args.json:
        write_record(args.json, baseline=args.baseline, threads=args.threads, results=figures)


if __name__ == "__main__":
    main()
