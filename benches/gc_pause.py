"""What the cyclic garbage collector costs a process that serves an engine,
before and after the `gc.freeze` the engine-core process and `ferrox
serve`'s frontend make once they are ready
(`common/runtime.freeze_long_lived_objects`).

    python benches/gc_pause.py [--process engine|frontend] [--model PATH]
        [--requests 2560] [--repeats 5] [--json FILE]

`engine` (the default) loads the model as `LLM` does, in this process;
`frontend` builds the application `ferrox serve` runs (its engine in a
process of its own) and sends it requests in this process, without a
socket. Then twice, first with every object scanned, then frozen as the
server freezes them at start-up: serves `--requests` short requests (batches
of 64, 4 greedy tokens each) and counts the collections CPython ran
meanwhile in this process, per generation, with their longest and total
pause; then times `gc.collect()` `--repeats` times: the full collection
CPython runs once enough objects outlive its younger generations, in the
middle of whatever step (or, in the frontend, whichever stream's event)
is running. Prints the tracked objects, the counts and the pauses, median
(min-max).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable
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


Batch = Callable[[list[str]], None]


@contextlib.contextmanager
def engine_batches(model: str | None) -> Any:
    """Greedy 4-token batches through `LLM.generate` in this process."""
    from ferrox import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    yield lambda prompts: llm.generate(prompts, params, use_tqdm=False)


@contextlib.asynccontextmanager
async def _frontend(model: str | None) -> AsyncIterator[Callable[[list[str]], Any]]:
    import httpx

    from ferrox.server.launch import build_parser, build_server_app

    argv = [] if model is None else [model]
    parts = build_server_app(build_parser().parse_args([*argv, "--max-num-seqs", "64"]), print)
    app = parts.app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:

            async def batch(prompts: list[str]) -> None:
                bodies = [
                    {"model": parts.names[0], "prompt": p, "max_tokens": 4, "temperature": 0,
                     "ignore_eos": True}
                    for p in prompts
                ]  # fmt: skip
                answers = await asyncio.gather(
                    *(client.post("/v1/completions", json=b, timeout=600) for b in bodies)
                )
                assert all(a.status_code == 200 for a in answers), answers[0].text

            yield batch


@contextlib.contextmanager
def frontend_batches(model: str | None) -> Any:
    """The same batches as requests to `ferrox serve`'s application, its
    event loop in this process."""
    loop = asyncio.new_event_loop()
    served = _frontend(model)
    batch = loop.run_until_complete(served.__aenter__())
    try:
        yield lambda prompts: loop.run_until_complete(batch(prompts))
    finally:
        loop.run_until_complete(served.__aexit__(None, None, None))
        loop.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--process", choices=("engine", "frontend"), default="engine")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--requests", type=int, default=2560)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = engine_batches if args.process == "engine" else frontend_batches
    with batches(args.model) as run_batch:
        results = measure_both(run_batch, args.requests, args.repeats)
    if args.json:
        write_record(args.json, process=args.process, requests=args.requests, **results)
    return 0


def measure_both(run_batch: Batch, requests: int, repeats: int) -> dict[str, Any]:
    from ferrox.common.runtime import freeze_long_lived_objects, thaw_long_lived_objects

    def measure(name: str) -> dict[str, Any]:
        seen = Collections()
        gc.callbacks.append(seen)
        start = time.perf_counter()
        for first in range(0, requests, 64):
            run_batch(
                [f"Request {name} {i}: tell me about item {i}." for i in range(first, first + 64)]
            )
        seconds = time.perf_counter() - start
        gc.callbacks.remove(seen)
        figures = {
            "serving_seconds": seconds,
            "collections": {g: len(p) for g, p in seen.pauses.items()},
            "longest_ms": {g: max(p, default=0.0) for g, p in seen.pauses.items()},
            "total_ms": {g: sum(p) for g, p in seen.pauses.items()},
            "tracked_objects": len(gc.get_objects()),
            "frozen_objects": gc.get_freeze_count(),
            "full_collection_ms": full_collections(repeats),
        }
        print(
            f"{name}: {figures['tracked_objects']} objects scanned; {requests} requests in "
            f"{seconds:.1f} s, collections by generation {figures['collections']}, longest "
            f"{ {g: round(v, 2) for g, v in figures['longest_ms'].items()} } ms; a full "
            f"collection {spread(figures['full_collection_ms'], ' ms', 2)}"
        )
        return figures

    run_batch(["warm up"])
    results = {"scanned": measure("scanned")}
    freeze_long_lived_objects()
    results["frozen"] = measure("frozen")
    thaw_long_lived_objects()
    return results


if __name__ == "__main__":
    raise SystemExit(main())
