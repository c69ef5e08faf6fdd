"""Do requests with new grammars stall the streams already running?

    python benches/grammar_arrivals.py                 # bundled model, 3 repeats
    python benches/grammar_arrivals.py --arrivals 40 --repeats 1

Four plain greedy streams decode; once they are under way, `--arrivals`
requests arrive together, each with a JSON schema of its own (an agent's
tool schemas: enums, patterns, nested objects) that no request used before.
The figure is the running streams' largest gap between two tokens while the
arrivals are admitted, against the same arrivals with the same prompts and
no constraint (their prefill costs the same; only the grammars differ), and
against the same schemas once compiled (a second wave of those schemas).
Prints median and spread of each; goal: the new-schema gap under 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import ferrox  # noqa: F401 (before torch work: ferrox tunes OpenMP for its CPU kernels)
from ferrox import AsyncLLM, SamplingParams
from ferrox.common.structured_outputs import StructuredOutputsParams
from machine import cpu_description, write_record

STREAM_TOKENS = 160
ARRIVAL_TOKENS = 24


def schema(i: int, wave: int) -> dict[str, Any]:
    """A schema no other (i, wave) shares: its names, enums and patterns differ."""
    tag = f"{wave}_{i}"
    return {
        "type": "object",
        "properties": {
            f"tool_{tag}": {"enum": [f"search_{tag}", f"fetch_{tag}", f"write_{tag}"]},
            f"query_{tag}": {"type": "string", "pattern": f"^[a-z]{{1,{8 + i % 7}}}( [a-z]+)*$"},
            f"limit_{tag}": {"type": "integer", "minimum": 1, "maximum": 50 + i},
            f"filters_{tag}": {
                "type": "object",
                "properties": {
                    f"site_{tag}": {"type": "string", "maxLength": 20 + i % 5},
                    f"after_{tag}": {"type": "string", "format": "date"},
                },
                "required": [f"site_{tag}"],
                "additionalProperties": False,
            },
        },
        "required": [f"tool_{tag}", f"query_{tag}"],
        "additionalProperties": False,
    }


async def one_round(llm: AsyncLLM, mode: str, arrivals: int, wave: int) -> float:
    """The running streams' largest token gap (s) while `arrivals` requests join."""
    stream_params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    gaps: list[float] = []
    arrived = asyncio.Event()
    start_arrivals = asyncio.Event()

    async def stream(k: int) -> None:
        last = None
        count = 0
        async for _ in llm.generate(
            f"Story {wave}-{k}: once upon a time", stream_params, f"s{mode}{wave}{k}"
        ):
            now = time.monotonic()
            count += 1
            if count == 8:
                start_arrivals.set()
            if last is not None and start_arrivals.is_set() and not arrived.is_set():
                gaps.append(now - last)
            last = now

    async def arrival(i: int) -> None:
        structured = None
        if mode != "plain":
            structured = StructuredOutputsParams(json=schema(i, 0 if mode == "cached" else wave))
        params = SamplingParams(
            temperature=0.0, max_tokens=ARRIVAL_TOKENS, structured_outputs=structured
        )
        prompt = f"Call tool {i} for the user's question number {i}, as JSON."
        async for _ in llm.generate(prompt, params, f"a{mode}{wave}{i}"):
            pass

    async def arrivals_when_ready() -> None:
        await start_arrivals.wait()
        await asyncio.gather(*(arrival(i) for i in range(arrivals)))
        arrived.set()

    await asyncio.gather(*(stream(k) for k in range(4)), arrivals_when_ready())
    return max(gaps) if gaps else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[float]] = {"plain": [], "new schemas": [], "cached schemas": []}
    options: dict[str, Any] = {"max_num_seqs": 64}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    async with AsyncLLM(args.model, **options) as llm:
        # Warm up: the vocabulary's index for the grammar engine, the kernels,
        # and wave 0's schemas (which "cached" reuses).
        await one_round(llm, "cached", args.arrivals, 0)
        for r in range(args.repeats):
            wave = r + 1
            results["plain"].append(await one_round(llm, "plain", args.arrivals, wave))
            results["new schemas"].append(await one_round(llm, "new", args.arrivals, wave))
            results["cached schemas"].append(await one_round(llm, "cached", args.arrivals, wave))
    return {
        name: {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "runs": values,
        }
        for name, values in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--arrivals", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the engine's step budget"
    )
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    figures = asyncio.run(run(args))
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    print(f"4 streams running; {args.arrivals} requests arrive together. Largest token gap:")
    for name, f in figures.items():
        spread = f"(min {f['min_s']:.3f}, max {f['max_s']:.3f})"
        print(f"  {name:15s} median {f['median_s']:.3f} s  {spread}")
    new, plain = figures["new schemas"]["median_s"], figures["plain"]["median_s"]
    print(f"new schemas / plain arrivals: {new / plain:.2f}x (goal for the gap: < 0.5 s)")
    if args.json:
        write_record(
            args.json,
            arrivals=args.arrivals,
            max_num_batched_tokens=args.max_num_batched_tokens,
            figures=figures,
        )


if __name__ == "__main__":
    main()
