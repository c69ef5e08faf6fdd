"""Freed memory kept in glibc's heap (common/runtime.py) against glibc's own
thresholds, each in a process of its own, alternating: resident memory once
`LLM()` has loaded the bundled model, and single-stream decode tok/s (a
256-token prompt, 128 greedy tokens). The other side is run with
`GLIBC_TUNABLES` set (empty), which ferrox leaves alone.

    python benches/freed_memory.py [--repeats 3] [--json FILE]

(`benches/quant_batches.py --baseline REV` measures the offline batch.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from machine import spread, write_record  # isort: skip

SIDES = {"kept": {}, "glibc's own": {"GLIBC_TUNABLES": ""}}


def measure() -> dict[str, object]:
    from ferrox import LLM, SamplingParams  # isort: skip  (before torch)
    from ferrox.common import runtime

    llm = LLM()
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    prompt = [1, *range(1000, 1255)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([prompt[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time and m.last_token_time
    return {
        "kept": runtime.FREED_MEMORY_KEPT,
        "rss_after_load_mib": rss / 2**20,
        "decode_tok_s": 127 / (m.last_token_time - m.first_token_time),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for r in range(args.repeats):
        for side, extra in SIDES.items():
            env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | extra
            done = subprocess.run(
                [sys.executable, __file__, "--child"],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            assert result["kept"] == (side == "kept"), result
            runs[side].append(result)
            print(f"run {r + 1} {side:>12}: {result}", flush=True)
    for key in ("rss_after_load_mib", "decode_tok_s"):
        cells = "  ".join(f"{side}: {spread([x[key] for x in runs[side]])}" for side in SIDES)
        print(f"{key:>20}  {cells}")
    if args.json:
        write_record(args.json, runs=runs)


if __name__ == "__main__":
    main()
