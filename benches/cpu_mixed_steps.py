"""One mixed step on the CPU: the fused layers against the module path.

The bundled model runs `--decodes` streams over a cached 700-token prompt;
then, step after step, a new request arrives whose prompt is that prompt
plus `--tails` tokens of its own, so the next step holds the decodes and
one row of that many query tokens behind a context. That step is timed
with the fused layers (`FusedCpuDecode`, whatever its token limit) and on
the module path, alternating in one process, `--repeats` times each:

    python benches/cpu_mixed_steps.py [--tails 20,60,100,160,200,600] [--decodes 15]
    FERROX_CPU_ISA=avx2 python benches/cpu_mixed_steps.py

Prints each path's median milliseconds and module / fused per pair, median
(min-max): where that ratio falls below 1 sets
`cpu_decoder.FUSED_MAX_TOKENS_LONG_ROWS`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ferrox  # noqa: F401  # isort: skip  (before torch)
import numpy as np

from ferrox import LLM, SamplingParams
from ferrox.layers import cpu_decoder
from ferrox.layers.attention.cpu_backend import SHORT_QUERY_LEN

from machine import cpu_description, spread, write_record  # isort: skip

SYSTEM_LEN = 700


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tails", default="20,60,100,160,200,600")
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}")
    limit = cpu_decoder.FUSED_MAX_TOKENS_LONG_ROWS
    llm = LLM(max_num_seqs=64, max_model_len=4096)
    engine = llm.engine
    rng = np.random.default_rng(0)
    system = rng.integers(100, 20000, SYSTEM_LEN).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": system}], one, use_tqdm=False)  # cached from here
    endless = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    for i in range(args.decodes):
        engine.add_request(f"decode-{i}", system + rng.integers(100, 20000, 30).tolist(), endless)
    for _ in range(3):
        engine.step()
    figures: dict[str, Any] = {}
    arrivals = 0
    try:
        for tail in (int(t) for t in args.tails.split(",")):
            seconds: dict[str, list[float]] = {"module": [], "fused": []}
            for _ in range(args.repeats):
                for path in seconds:
                    # module: no step with a long row runs fused; fused: any such step does
                    cpu_decoder.FUSED_MAX_TOKENS_LONG_ROWS = (
                        SHORT_QUERY_LEN if path == "module" else 1 << 30
                    )
                    engine.step()
                    arrivals += 1
                    prompt = system + rng.integers(100, 20000, tail).tolist()
                    engine.add_request(f"tail-{arrivals}", prompt, one)
                    start = time.perf_counter()
                    engine.step()
                    seconds[path].append(time.perf_counter() - start)
            ratios = [m / f for m, f in zip(seconds["module"], seconds["fused"], strict=True)]
            ms = {k: statistics.median(v) * 1e3 for k, v in seconds.items()}
            print(
                f"tail of {tail} + {args.decodes} decodes ({tail + args.decodes} tokens): "
                f"module {ms['module']:.1f} ms, fused {ms['fused']:.1f} ms, "
                f"module / fused {spread(ratios, digits=2)}"
            )
            figures[str(tail)] = {"seconds": seconds, "module_over_fused": ratios}
    finally:
        cpu_decoder.FUSED_MAX_TOKENS_LONG_ROWS = limit
        for rid in engine.request_ids():
            engine.abort_request(rid)
    if args.json:
        write_record(args.json, args=vars(args), figures=figures)


if __name__ == "__main__":
    main()
