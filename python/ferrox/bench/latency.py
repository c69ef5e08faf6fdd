"""`ferrox bench latency`: one fixed batch through the engine, no server:
prefill time for the whole batch, then per-step decode time."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

import numpy as np

from ferrox.common.engine_args import add_engine_arguments, engine_options
from ferrox.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrox.engine.core import EngineCore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2, help="measured runs (after one warm-up)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")
    add_engine_arguments(parser)


def measure(
    engine: EngineCore, batch: int, input_len: int, output_len: int, seed: int
) -> dict[str, float]:
    """Prefill seconds (until every request has its first token) and the
    median decode step seconds of one batch."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        prompt = rng.integers(0, engine.vocab_size, size=input_len).tolist()
        engine.add_request(f"lat-{seed}-{i}", prompt, params)
    started: set[str] = set()
    start = time.perf_counter()
    while len(started) < batch:
        started.update(d.request_id for d in engine.step()[0] if d.token_ids)
    prefill = time.perf_counter() - start
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return {
        "prefill_s": prefill,
        "decode_step_s": float(np.median(steps)) if steps else float("nan"),
    }


def main(args: argparse.Namespace) -> int:
    from ferrox.llm import LLM  # the engine (and torch) only when this command runs

    llm = LLM(**engine_options(args))
    runs = [
        measure(llm.engine, args.batch_size, args.input_len, args.output_len, seed)
        for seed in range(args.runs + 1)
    ][1:]  # the first run warms up
    prefill = float(np.median([r["prefill_s"] for r in runs]))
    step = float(np.median([r["decode_step_s"] for r in runs]))
    from ferrox.parallel.device import torch_device, torch_dtype

    result = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefill_s": prefill,
        "prefill_tok_s": args.batch_size * args.input_len / prefill,
        "decode_step_ms": step * 1e3,
        "decode_tok_s": args.batch_size / step,
        "device": str(torch_device(llm.config)),
        "dtype": str(torch_dtype(llm.config)),
    }
    print(
        f"batch {args.batch_size} x {args.input_len} in / {args.output_len} out "
        f"on {result['device']}: "
        f"prefill {prefill * 1e3:.1f} ms ({result['prefill_tok_s']:.0f} tok/s), "
        f"decode step {step * 1e3:.2f} ms ({result['decode_tok_s']:.1f} tok/s)"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0
