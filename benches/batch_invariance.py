"""What `batch_invariant` costs on the bundled model: the same work with the
option off and on, two engines in one process, alternating:

  prefill   one prompt of 256, 1024 and 2048 tokens, one output token
            (prefix caching off): seconds
  offline   64 requests of 64-256 random prompt tokens, 128 greedy tokens
            each (EOS ignored): output tok/s
  single    a 256-token prompt, 128 greedy tokens: tok/s

    python benches/batch_invariance.py [--repeats 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import ferrox  # noqa: F401  # isort: skip  (before torch)
import numpy as np

from ferrox import LLM, SamplingParams

from machine import write_record  # isort: skip

PREFILL_LENGTHS = (256, 1024, 2048)


def measure(llm: LLM, rng_seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(rng_seed)
    found: dict[str, float] = {}
    for n in PREFILL_LENGTHS:
        prompt = [1, *rng.integers(100, 49000, size=n - 1).tolist()]
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        found[f"prefill_{n}_s"] = time.perf_counter() - start
    lengths = rng.integers(64, 257, size=64)
    prompts = [rng.integers(100, 49000, size=int(n)).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    found["offline_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (
        time.perf_counter() - start
    )
    start = time.perf_counter()
    llm.generate([[1, *range(1000, 1255)]], params, use_tqdm=False)
    found["single_tok_s"] = 128 / (time.perf_counter() - start)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engines = {
        mode: LLM(max_num_seqs=64, enable_prefix_caching=False, batch_invariant=mode == "on")
        for mode in ("off", "on")
    }
    for llm in engines.values():  # warm-up
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    for r in range(args.repeats):
        for mode, llm in engines.items():
            runs[mode].append(measure(llm))
            print(f"run {r + 1} batch_invariant {mode}: {runs[mode][-1]}", flush=True)
    print(f"\n{'figure':<18}{'off':>24}{'on':>24}{'on/off':>22}")
    for key in runs["off"][0]:

        def cell(values: list[float], digits: int = 2) -> str:
            low, mid, high = min(values), statistics.median(values), max(values)
            return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"

        off = [run[key] for run in runs["off"]]
        on = [run[key] for run in runs["on"]]
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        print(f"{key:<18}{cell(off):>24}{cell(on):>24}{cell(ratios):>22}")
    print("(prefill: seconds, higher on/off is slower; tok/s: lower on/off is slower)")
    if args.json:
        write_record(args.json, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
