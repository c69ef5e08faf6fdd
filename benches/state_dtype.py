"""A hybrid model's recurrent state in float32 against bfloat16
(`mamba_ssm_cache_dtype`), one engine each in one process, taking turns:

  single    one 256-token prompt, 128 greedy tokens: decode tok/s (first to
            last token, from the request's metrics)
  batch     16 streams of 64-token prompts, 128 greedy tokens each, one
            `LLM.generate`: output tok/s

each repeat's bfloat16 / float32 ratio (median, min-max), which of the two
engines goes first alternating from repeat to repeat; and what the state
costs and changes: one sequence's state in each, and the bfloat16 engine's
greedy tokens against the float32 one's on the 16 prompts (tokens equal
before the first difference, and the largest gap between the two engines'
logprobs of the same token up to there).

    python benches/state_dtype.py --model FILE.gguf [--repeats 7] [--json FILE]

`--model`: a hybrid GGUF with the bundled model's vocabulary, such as the
one `python benches/make_bench_gguf.py --family qwen3.5` writes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrox import LLM, SamplingParams  # isort: skip  (before torch)
import numpy as np

from machine import cpu_description, spread, write_record  # isort: skip

OUTPUT_LEN = 128
SINGLE_PROMPT, STREAMS, STREAM_PROMPT = 256, 16, 64
DTYPES = ("float32", "bfloat16")


def single_decode(llm: LLM) -> float:
    llm.reset_prefix_cache()
    prompt = [1, *range(1000, 1000 + SINGLE_PROMPT - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time and m.last_token_time
    return (OUTPUT_LEN - 1) / (m.last_token_time - m.first_token_time)


def batch_rate(llm: LLM, prompts: list[list[int]]) -> float:
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def agreement(engines: dict[str, LLM], prompts: list[list[int]]) -> dict[str, Any]:
    """The bfloat16 engine's greedy tokens against the float32 one's."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True, logprobs=1)
    runs = {}
    for name, llm in engines.items():
        llm.reset_prefix_cache()
        runs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    same, gaps = [], []
    for wide, half in zip(runs["float32"], runs["bfloat16"], strict=True):
        pairs = enumerate(zip(wide.token_ids, half.token_ids, strict=True))
        n = next((i for i, (a, b) in pairs if a != b), OUTPUT_LEN)
        same.append(n)
        gaps += [
            abs(wide.logprobs[i][t].logprob - half.logprobs[i][t].logprob)
            for i, t in enumerate(wide.token_ids[:n])
        ]
    return {
        "tokens_before_first_difference": same,
        "identical_streams": sum(n == OUTPUT_LEN for n in same),
        "max_logprob_gap": max(gaps),
        "median_logprob_gap": float(np.median(gaps)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a hybrid GGUF file")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = str(Path(args.model).expanduser())
    engines = {
        d: LLM(model, mamba_ssm_cache_dtype=d, max_num_seqs=STREAMS, max_model_len=1024)
        for d in DTYPES
    }
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 49000, size=STREAM_PROMPT).tolist() for _ in range(STREAMS)]
    state_mib = {d: e.engine.runner.kv_groups.state_bytes / 2**20 for d, e in engines.items()}
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    for llm in engines.values():
        llm.generate([prompts[0][:8]], warm, use_tqdm=False)
    measures: dict[str, Callable[[LLM], float]] = {
        "single": single_decode,
        "batch": lambda llm: batch_rate(llm, prompts),
    }
    runs: dict[str, dict[str, list[float]]] = {d: {w: [] for w in measures} for d in DTYPES}
    for r in range(args.repeats):
        order = DTYPES if r % 2 == 0 else DTYPES[::-1]
        for workload, measure in measures.items():
            for d in order:
                runs[d][workload].append(measure(engines[d]))
        last = [f"{d} single {runs[d]['single'][-1]:.1f} batch {runs[d]['batch'][-1]:.1f}"
                for d in DTYPES]  # fmt: skip
        print(f"run {r + 1}: " + ", ".join(last), flush=True)
    quality = agreement(engines, prompts)
    print(f"\nCPU: {cpu_description()}")
    print("one sequence's state: " + ", ".join(f"{d} {state_mib[d]:.2f} MiB" for d in DTYPES))
    ratios = {}
    for workload, label in (("single", "single-stream decode"), ("batch", f"{STREAMS} streams")):
        for d in DTYPES:
            print(f"{label:>22} {d:>9}: {spread(runs[d][workload])} tok/s")
        pairs = zip(runs["bfloat16"][workload], runs["float32"][workload], strict=True)
        ratios[workload] = [h / w for h, w in pairs]
        print(f"{label:>22} bfloat16/float32 per repeat: {spread(ratios[workload], 'x', 3)}")
    print(
        f"greedy agreement over {STREAMS} streams of {OUTPUT_LEN} tokens: "
        f"{quality['identical_streams']} identical; tokens before the first difference "
        f"{sorted(quality['tokens_before_first_difference'])}; logprob gap up to there "
        f"median {quality['median_logprob_gap']:.2e}, max {quality['max_logprob_gap']:.2e}"
    )
    if args.json:
        write_record(args.json, model=Path(model).name, state_mib=state_mib, runs=runs,
                     ratios=ratios, agreement=quality)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
