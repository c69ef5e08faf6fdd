"""One conversation on the CPU through ferrox's weight paths, side by side in
one process: the GGUF file's blocks with whole decoder layers in one native
call (the default), the same blocks layer by layer (`fused_decode` off), and
the weights dequantized to float32 (`quantization="none"`).

    python benches/cpu_decode_paths.py [--repeats 3] [--json FILE]

Each repeat runs every path once, alternating; a run is a 256-token prompt
(prefix caching off) and 128 greedy tokens. Prints tokens per second of the
whole request and of its decode alone (median, min-max) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ferrox import LLM, SamplingParams  # isort: skip  (before torch: see docs/performance.md)
from ferrox.model_files import default_model_path

PROMPT = [1, *range(1000, 1255)]  # 256 tokens
NEW_TOKENS = 128


def timed(llm: LLM, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPT], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = str(default_model_path())
    blocks = LLM(model, max_num_seqs=1, enable_prefix_caching=False)
    dense = LLM(model, max_num_seqs=1, enable_prefix_caching=False, quantization="none")
    fused = blocks.engine.runner.model.fused_decode
    assert fused is not None, "the default model should run fused decode steps"

    def use(path: str) -> LLM:
        blocks.engine.runner.model.fused_decode = fused if path == "blocks, fused" else None
        return dense if path == "float32" else blocks

    paths = ["blocks, fused", "blocks, layer by layer", "float32"]
    whole: dict[str, list[float]] = {p: [] for p in paths}
    decode: dict[str, list[float]] = {p: [] for p in paths}
    for p in paths:
        timed(use(p), 4)  # warm-up
    for _ in range(args.repeats):
        for p in paths:
            llm = use(p)
            prefill = timed(llm, 1)
            total = timed(llm, NEW_TOKENS)
            whole[p].append(NEW_TOKENS / total)
            decode[p].append((NEW_TOKENS - 1) / max(total - prefill, 1e-9))
    print(f"{'path':24} {'request tok/s':>22} {'decode tok/s':>22}")
    for p in paths:
        cells = [
            f"{statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})"
            for v in (whole[p], decode[p])
        ]
        print(f"{p:24} {cells[0]:>22} {cells[1]:>22}")
    base = statistics.median(decode["float32"])
    for p in paths[:2]:
        print(f"{p} / float32, decode: {statistics.median(decode[p]) / base:.2f}x")
    fused_rate = statistics.median(decode["blocks, fused"])
    layered = statistics.median(decode["blocks, layer by layer"])
    print(f"fused / layer by layer, decode: {fused_rate / layered:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"whole": whole, "decode": decode}, indent=2) + "\n")


if __name__ == "__main__":
    main()
