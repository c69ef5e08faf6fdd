"""What `batch_invariant` costs on the bundled model: the same work with the
option off and on, two engines in one process, alternating:

  prefill   one prompt of 256, 1024 and 2048 tokens, one output token
            (prefix caching off): seconds
  offline   64 requests of 64-256 random prompt tokens, 128 greedy tokens
            each (EOS ignored): output tok/s
  single    a 256-token prompt, 128 greedy tokens: tok/s

and first, what the option buys: a 300-token prompt's 24 greedy tokens
alone, then with 200 of its tokens cached, then in 64-token steps: whether
the tokens stay the same and the largest change of a logprob.

    python benches/batch_invariance.py [--repeats 2] [--drift-only] [--json FILE]
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


def drift(mode: str) -> dict[str, float]:
    """Largest |logprob change| (and whether tokens changed) against the
    prompt alone, with a prefix hit and with 64-token steps."""
    rng = np.random.default_rng(1)
    prompt = [1, *rng.integers(100, 49000, size=300).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)

    def greedy(llm: LLM) -> tuple[list[int], list[float]]:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ids = list(out.token_ids)
        return ids, [d[t].logprob for d, t in zip(out.logprobs or [], ids, strict=True)]

    invariant = mode == "on"
    llm = LLM(max_num_seqs=8, batch_invariant=invariant)
    alone = greedy(llm)
    llm.reset_prefix_cache()
    llm.generate([prompt[:200]], SamplingParams(max_tokens=1), use_tqdm=False)
    found = {"prefix hit": greedy(llm)}
    del llm
    chunked = LLM(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
                  batch_invariant=invariant)  # fmt: skip
    found["64-token steps"] = greedy(chunked)
    result: dict[str, float] = {}
    for name, (ids, logprobs) in found.items():
        result[f"{name}: tokens changed"] = float(ids != alone[0])
        result[f"{name}: max |d logprob|"] = max(
            abs(a - b) for a, b in zip(logprobs, alone[1], strict=True)
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--drift-only", action="store_true", help="only what the option buys")
    args = parser.parse_args()
    drifts = {mode: drift(mode) for mode in ("off", "on")}
    for mode, found in drifts.items():
        print(f"batch_invariant {mode}: " + ", ".join(f"{k} {v:.4f}" for k, v in found.items()))
    if args.drift_only:
        if args.json:
            write_record(args.json, drift=drifts)
        return 0
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
        write_record(args.json, drift=drifts, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
