"""Offline throughput: the same model and requests through ferrox, through
transformers `generate` (static batches) and through transformers
`generate_batch` (its continuous batching), in one run.

    python benches/offline_throughput.py --workload both
    python benches/offline_throughput.py --workload random --num-requests 16  # quick look

Workloads (greedy, EOS ignored so every engine produces the same count):
  random:        N requests of 32-256 random prompt tokens, 64 output tokens
  shared-prefix: a 1,000-token system prompt + N distinct 32-token questions,
                 32 output tokens each

Prints output tokens/s per engine and ferrox's ratio to the faster
transformers path; `--json` writes the figures.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import ferrox  # noqa: F401  # isort: skip  (before torch: ferrox tunes OpenMP for its CPU kernels)
from machine import write_record  # isort: skip
from ferrox._native import cpu_isa  # isort: skip
import numpy as np
import torch


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int


def make_workload(name: str, num_requests: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(100, 49000, size=n).tolist()

    if name == "random":
        prompts = [tokens(int(rng.integers(32, 257))) for _ in range(num_requests)]
        return Workload(name, prompts, 64)
    system = tokens(1000)
    return Workload(name, [system + tokens(32) for _ in range(num_requests)], 32)


_LLMS: dict[str | None, object] = {}


def run_ferrox(w: Workload, model: str | None) -> tuple[float, int]:
    from ferrox import LLM, SamplingParams

    if model not in _LLMS:
        _LLMS[model] = LLM(model, max_num_seqs=max(64, len(w.prompts)))
    llm = _LLMS[model]
    sp = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    llm.generate(w.prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # type: ignore[attr-defined]
    # A repeat of the same prompts would find them in the prefix cache.
    llm.reset_prefix_cache()  # type: ignore[attr-defined]
    start = time.perf_counter()
    outs = llm.generate(w.prompts, sp, use_tqdm=False)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_model(model: str | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from ferrox.loader.gguf import load_gguf
    from ferrox.model_files import default_model_path

    path = model or str(default_model_path())
    if path.endswith(".gguf"):
        gguf = load_gguf(path)
        hf = LlamaForCausalLM(gguf.config)
        hf.load_state_dict(gguf.state_dict, strict=False)
        hf.tie_weights()
        return hf.eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf_static(w: Workload, hf: torch.nn.Module, batch_size: int) -> tuple[float, int]:
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(w.prompts), batch_size):
        batch = w.prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(batch):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=w.max_tokens,
            min_new_tokens=w.max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        produced += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - start, produced


@torch.inference_mode()
def run_hf_continuous(w: Workload, hf: torch.nn.Module) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=w.max_tokens,
        min_new_tokens=w.max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    start = time.perf_counter()
    outs = hf.generate_batch(inputs=w.prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.generated_tokens) for o in outs.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workload", choices=["random", "shared-prefix", "both"], default="both")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--engines", default="ferrox,hf-static,hf-continuous")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of ferrox and of transformers generate; the faster counts (the first "
        "also warms up). generate_batch runs once: it is several times slower",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    engines = args.engines.split(",")
    names = ["random", "shared-prefix"] if args.workload == "both" else [args.workload]
    hf = hf_model(args.model) if any(e.startswith("hf") for e in engines) else None
    results = []
    for name in names:
        w = make_workload(name, args.num_requests, args.seed)
        runs: dict[str, Callable[[], tuple[float, int]]] = {
            "ferrox": lambda w=w: run_ferrox(w, args.model),
            "hf-static": lambda w=w: run_hf_static(w, hf, args.hf_batch_size),
            "hf-continuous": lambda w=w: run_hf_continuous(w, hf),
        }
        row: dict[str, object] = {"workload": name, "num_requests": len(w.prompts)}
        for engine in engines:
            repeats = 1 if engine == "hf-continuous" else max(args.repeats, 1)
            elapsed, produced = min(runs[engine]() for _ in range(repeats))
            row[engine] = {
                "seconds": elapsed,
                "output_tokens": produced,
                "tok_s": produced / elapsed,
            }
            print(
                f"{name:>14} {engine:>14}: {produced:6d} tokens in {elapsed:7.1f} s "
                f"= {produced / elapsed:8.1f} tok/s",
                flush=True,
            )
        hf_rates = [row[e]["tok_s"] for e in engines if e.startswith("hf")]  # type: ignore[index]
        if "ferrox" in engines and hf_rates:
            ratio = row["ferrox"]["tok_s"] / max(hf_rates)  # type: ignore[index]
            row["ratio_vs_best_hf"] = ratio
            print(f"{name:>14} ferrox / best transformers = {ratio:.2f}x", flush=True)
        results.append(row)
    if args.json:
        write_record(args.json, isa=cpu_isa(), torch=torch.__version__, results=results)


if __name__ == "__main__":
    main()
