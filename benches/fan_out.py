"""An agent's fan-out: requests that share a long prefix and arrive together.

    python benches/fan_out.py                       # bundled model, 32 x 1000-token prefix
    python benches/fan_out.py --requests 16 --prefix-tokens 500 --repeats 1
    python benches/fan_out.py --baseline REF        # also a git revision's code

Each round submits `--requests` prompts at once: one shared prefix of
`--prefix-tokens` tokens (fresh each round) and a short suffix of its own,
`--output-tokens` greedy tokens each. "cold": the prefix is in no cache;
"warm": the same prompts again, the prefix now cached. Prints output tok/s
and wall time of each, median (min-max) over the repeats, and cold / warm
(goal: at least 0.8). With `--baseline REF`, each repeat runs the current
code and REF's, each in a fresh process, one after the other, and prints the
ratios of each pair.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baseline import ROOT, build_baseline, remove_baseline, run_child
from machine import cpu_description, spread, write_record

if TYPE_CHECKING:
    from ferrox import LLM, SamplingParams

Run = tuple[float, float]  # output tok/s, seconds


def round_prompts(llm: LLM, round_no: int, requests: int, prefix_tokens: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    words = " ".join(f"fact{round_no}-{i} is filed under topic {i % 17}." for i in range(400))
    prefix = tokenizer.encode(f"Round {round_no}. Shared context: {words}")[:prefix_tokens]
    if len(prefix) < prefix_tokens:
        raise SystemExit(f"the prefix text gives only {len(prefix)} tokens")
    return [
        prefix + tokenizer.encode(f" Sub-task {i}: summarise fact {i}.") for i in range(requests)
    ]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / seconds, seconds


def measure(args: argparse.Namespace, rounds: range) -> dict[str, list[Run]]:
    """Cold and warm runs, one pair per round (each round's own prefix)."""
    import ferrox  # noqa: F401  # isort: skip  (before torch: ferrox tunes OpenMP)
    from ferrox import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=max(64, args.requests), max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    timed(llm, round_prompts(llm, 0, 4, 64), params)  # warm up the kernels
    runs: dict[str, list[Run]] = {"cold": [], "warm": []}
    for r in rounds:
        prompts = round_prompts(llm, r + 1, args.requests, args.prefix_tokens)
        llm.reset_prefix_cache()
        runs["cold"].append(timed(llm, prompts, params))
        runs["warm"].append(timed(llm, prompts, params))
    return runs


def report(name: str, runs: dict[str, list[Run]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for kind, values in runs.items():
        rates, seconds = [v[0] for v in values], [v[1] for v in values]
        figures[kind] = {"tok_s": rates, "seconds": seconds}
        print(f"  {name}{kind}: {spread(rates)} tok/s, {statistics.median(seconds):.2f} s")
    ratios = [c[0] / w[0] for c, w in zip(runs["cold"], runs["warm"], strict=True)]
    figures["cold_over_warm"] = ratios
    print(f"  {name}cold / warm: {spread(ratios, digits=2)}; goal >= 0.8")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--child-round", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_round is not None:
        print(json.dumps(measure(args, range(args.child_round, args.child_round + 1))))
        return
    print(f"CPU: {cpu_description()}")
    print(
        f"{args.requests} requests, a {args.prefix_tokens}-token shared prefix, "
        f"{args.output_tokens} output tokens each:"
    )
    if args.baseline is None:
        figures = report("", measure(args, range(args.repeats)))
        if args.json:
            write_record(args.json, args=vars(args), figures=figures)
        return
    work = Path(tempfile.mkdtemp(prefix="ferrox-fan-out-"))
    try:
        versions = {
            "baseline": build_baseline(args.baseline, work / "baseline"),
            "current": ROOT / "python",
        }
        runs = {name: {"cold": [], "warm": []} for name in versions}
        argv = [a for a in sys.argv[1:] if not a.startswith("--baseline") and a != args.baseline]
        for r in range(args.repeats):
            for name, path in versions.items():
                result = run_child(__file__, path, [*argv, "--child-round", str(r)], {})
                for kind in ("cold", "warm"):
                    runs[name][kind] += [tuple(x) for x in result[kind]]
                print(f"run {r + 1} {name}: {result}", flush=True)
        figures = {name: report(f"{name} ", r) for name, r in runs.items()}
        for kind in ("cold", "warm"):
            pairs = zip(runs["current"][kind], runs["baseline"][kind], strict=True)
            ratios = [c[0] / b[0] for c, b in pairs]
            figures[f"{kind}_current_over_baseline"] = ratios
            print(f"  {kind} tok/s, current / baseline: {spread(ratios, 'x', 2)}")
        if args.json:
            write_record(args.json, args=vars(args), figures=figures)
    finally:
        remove_baseline(work / "baseline")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
