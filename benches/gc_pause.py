"""What the cyclic garbage collector costs a process that serves an engine,
before and after the engine-core process's `gc.freeze`
(`common/runtime.freeze_long_lived_objects`).

    python benches/gc_pause.py [--model PATH] [--requests 2560] [--repeats 5] [--json FILE]

Loads the model as `LLM` does, then twice, first with every object scanned,
then frozen as the engine-core process freezes them at start-up: serves
`--requests` short requests (batches of 64, 4 greedy tokens each) and counts
the collections CPython ran meanwhile, per generation, with their longest
and total pause; then times `gc.collect()` `--repeats` times: the full
collection CPython runs once enough objects outlive its younger generations,
in the middle of whatever step is running. Prints the tracked objects, the
counts and the pauses, median (min-max).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import ferrox  # noqa: F401  # isort: skip  (before torch: ferrox tunes OpenMP)
from machine import spread, write_record  # isort: skip


class Collections:
    """Pauses of the collections CPython runs by itself, per generation (ms)."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses[info["generation"]].append((time.perf_counter() - self._start) * 1e3)


def full_collections(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--requests", type=int, default=2560)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from ferrox import LLM, SamplingParams
    from ferrox.common.runtime import freeze_long_lived_objects, thaw_long_lived_objects

    llm = LLM(args.model, max_num_seqs=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def measure(name: str) -> dict[str, Any]:
        seen = Collections()
        gc.callbacks.append(seen)
        start = time.perf_counter()
        for first in range(0, args.requests, 64):
            prompts = [
                f"Request {name} {i}: tell me about item {i}." for i in range(first, first + 64)
            ]
            llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        gc.callbacks.remove(seen)
        figures = {
            "serving_seconds": seconds,
            "collections": {g: len(p) for g, p in seen.pauses.items()},
            "longest_ms": {g: max(p, default=0.0) for g, p in seen.pauses.items()},
            "total_ms": {g: sum(p) for g, p in seen.pauses.items()},
            "tracked_objects": len(gc.get_objects()),
            "frozen_objects": gc.get_freeze_count(),
            "full_collection_ms": full_collections(args.repeats),
        }
        print(
            f"{name}: {figures['tracked_objects']} objects scanned; {args.requests} requests in "
            f"{seconds:.1f} s, collections by generation {figures['collections']}, longest "
            f"{ {g: round(v, 2) for g, v in figures['longest_ms'].items()} } ms; a full "
            f"collection {spread(figures['full_collection_ms'], ' ms', 2)}"
        )
        return figures

    llm.generate(["warm up"], params, use_tqdm=False)
    results = {"scanned": measure("scanned")}
    freeze_long_lived_objects()
    results["frozen"] = measure("frozen")
    thaw_long_lived_objects()
    if args.json:
        write_record(args.json, requests=args.requests, **results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
