"""Waiting order and the prefix cache: FCFS against longest prefix match.

    python benches/prefix_order.py                 # bundled model, 8 groups x 4 requests
    python benches/prefix_order.py --repeats 1 --groups 6

Several agents each fan out sub-tasks over a long context of their own
(`--groups` prefixes of `--prefix-tokens` tokens, `--per-group` requests
each with a short task), all queued at once and interleaved across groups,
with a KV pool (`--kv-blocks`) that holds only a few of the prefixes beside
the running requests. In arrival order (fcfs) the cache evicts each prefix
before its group's next request comes up; longest prefix match (lpm) serves
the requests whose prefix is cached first. Each policy runs in its own engine
on the same prompts, alternating; prints output tok/s, wall time and the
share of prompt tokens served from the cache, median (min-max), and lpm /
fcfs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ferrox  # noqa: F401 (before torch work: ferrox tunes OpenMP for its CPU kernels)
from ferrox import LLM, SamplingParams
from machine import cpu_description, write_record


def prompts_for(llm: LLM, round_no: int, args: argparse.Namespace) -> list[list[int]]:
    """Interleaved across groups: group 0's first task, group 1's first, ..."""
    tokenizer = llm.get_tokenizer()
    prefixes = []
    for g in range(args.groups):
        words = " ".join(f"note{round_no}-{g}-{i} concerns item {i % 13}." for i in range(400))
        prefix = tokenizer.encode(f"Agent {g}, round {round_no}. Context: {words}")
        if len(prefix) < args.prefix_tokens:
            raise SystemExit(f"the prefix text gives only {len(prefix)} tokens")
        prefixes.append(prefix[: args.prefix_tokens])
    return [
        prefixes[g] + tokenizer.encode(f" Task {t}: list what item {t} concerns.")
        for t in range(args.per_group)
        for g in range(args.groups)
    ]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs if o.metrics)
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "cached_share": cached / sum(len(p) for p in prompts),
    }


def spread(values: list[float], digits: int = 1) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument(
        "--kv-blocks", type=int, default=160, help="KV pool, 16-token blocks (default 160)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    engines = {
        policy: LLM(
            args.model,
            scheduling_policy=policy,
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.kv_blocks,
            max_model_len=2048,
        )
        for policy in ("fcfs", "lpm")
    }
    for llm in engines.values():
        timed(llm, prompts_for(llm, 0, args)[:4], params)  # warm up the kernels
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in engines}
    for r in range(args.repeats):
        for policy, llm in engines.items():
            llm.reset_prefix_cache()
            runs[policy].append(timed(llm, prompts_for(llm, r + 1, args), params))
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    print(
        f"{args.groups} groups x {args.per_group} requests, {args.prefix_tokens}-token prefix "
        f"per group, {args.output_tokens} output tokens, {args.max_num_seqs} sequences, "
        f"{args.kv_blocks} KV blocks:"
    )
    figures: dict[str, Any] = {}
    for policy, values in runs.items():
        figures[policy] = {k: [v[k] for v in values] for k in values[0]}
        f = figures[policy]
        print(
            f"  {policy}: {spread(f['tok_s'])} tok/s, {spread(f['seconds'], 2)} s, "
            f"cached {spread(f['cached_share'], 3)} of prompt tokens"
        )
    ratios = [
        lpm["tok_s"] / fcfs["tok_s"] for lpm, fcfs in zip(runs["lpm"], runs["fcfs"], strict=True)
    ]
    print(f"lpm / fcfs output tok/s: {spread(ratios, 2)}")
    if args.json:
        write_record(args.json, args=vars(args), figures=figures, ratios=ratios)


if __name__ == "__main__":
    main()
