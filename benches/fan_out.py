"""An agent's fan-out: requests that share a long prefix and arrive together.

    python benches/fan_out.py                       # bundled model, 32 x 1000-token prefix
    python benches/fan_out.py --requests 16 --prefix-tokens 500 --repeats 1

Each round submits `--requests` prompts at once: one shared prefix of
`--prefix-tokens` tokens (fresh each round) and a short suffix of its own,
`--output-tokens` greedy tokens each. "cold": the prefix is in no cache;
"warm": the same prompts again, the prefix now cached. Prints output tok/s
and wall time of each, median (min-max) over the repeats, and cold / warm
(goal: at least 0.8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ferrox  # noqa: F401 (before torch work: ferrox tunes OpenMP for its CPU kernels)
from ferrox import LLM, SamplingParams
from machine import cpu_description, write_record


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=max(64, args.requests), max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    timed(llm, round_prompts(llm, 0, 4, 64), params)  # warm up the kernels
    runs: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    for r in range(args.repeats):
        prompts = round_prompts(llm, r + 1, args.requests, args.prefix_tokens)
        llm.reset_prefix_cache()
        runs["cold"].append(timed(llm, prompts, params))
        runs["warm"].append(timed(llm, prompts, params))
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    print(
        f"{args.requests} requests, a {args.prefix_tokens}-token shared prefix, "
        f"{args.output_tokens} output tokens each:"
    )
    figures: dict[str, Any] = {}
    for name, values in runs.items():
        rates = [v[0] for v in values]
        seconds = [v[1] for v in values]
        figures[name] = {"tok_s": rates, "seconds": seconds}
        print(
            f"  {name}: {statistics.median(rates):.1f} tok/s ({min(rates):.1f}-{max(rates):.1f}), "
            f"{statistics.median(seconds):.2f} s"
        )
    ratios = [c[0] / w[0] for c, w in zip(runs["cold"], runs["warm"], strict=True)]
    print(
        f"cold / warm: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); "
        "goal >= 0.8"
    )
    if args.json:
        write_record(args.json, args=vars(args), figures=figures, ratios=ratios)


if __name__ == "__main__":
    main()
