"""The engine's own cost per token, with a model that costs almost nothing.

A random Llama of 2 layers, hidden 64 and a 1,000-token vocabulary (the
default model's tokenizer, so detokenization is real) leaves the scheduler,
the sampler, the output path and the Python glue as nearly all the time.
Through the public `LLM.generate`:

  greedy    256 requests at once, 150 output tokens each, temperature 0
  sampling  the same with a mix of parameters: temperature, top-p,
            top-k + min-p, per-request seeds, penalties
  single    one request alone, 150 output tokens (ms per token)

Each figure comes twice: the whole time, and the host's share (the whole
time less the model's forward passes and LM head, clocked around them):
what scheduling, sampling, output processing and glue cost.

    python benches/host_overhead.py [--repeats 3]
    python benches/host_overhead.py --baseline REF [--repeats 3]

With `--baseline`, the same script also runs the code at git revision REF
(checked out in a temporary worktree, its native module built there) and
prints both, interleaved run by run, with the ratio baseline / current.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from baseline import ROOT, build_baseline, current_commit, remove_baseline  # isort: skip

NUM_REQUESTS = 256
OUTPUT_LEN = 150
PROMPT_LEN = 32
VOCAB = 1000


def make_model(folder: Path) -> Path:
    """config.json of the tiny Llama plus the default model's tokenizer."""
    from transformers import LlamaConfig

    from ferrox.model_files.default import default_model_path
    from ferrox.model_files.gguf_reader import load_gguf_tokenizer

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(folder)
    load_gguf_tokenizer(default_model_path()).save_pretrained(folder)
    return folder


def sampling_mix(i: int) -> Any:  # SamplingParams of whichever ferrox runs
    from ferrox import SamplingParams

    common = dict(max_tokens=OUTPUT_LEN, ignore_eos=True)
    kinds = [
        dict(temperature=0.8),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=50, min_p=0.05),
        dict(temperature=0.9, seed=1000 + i),
        dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1),
    ]
    return SamplingParams(**common, **kinds[i % len(kinds)])


def measure(model: Path) -> dict[str, float]:
    """Seconds for each workload, in this process, with whichever ferrox is importable."""
    import numpy as np

    from ferrox import LLM, SamplingParams

    llm = LLM(str(model), load_format="dummy", max_num_seqs=NUM_REQUESTS, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=PROMPT_LEN).tolist() for _ in range(NUM_REQUESTS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(prompts[:4], greedy, use_tqdm=False)  # warm-up

    # The model's own time (forward and LM head), so that the engine's share
    # (scheduling, sampling, output processing, glue) can be told apart.
    model = llm.engine.runner.model
    in_model = [0.0]

    def clocked(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                in_model[0] += time.perf_counter() - start

        return run

    model.forward = clocked(model.forward)
    model.compute_logits = clocked(model.compute_logits)

    def timed(batch: list[list[int]], params: object) -> tuple[float, float]:
        in_model[0] = 0.0
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != len(batch) * OUTPUT_LEN:
            raise RuntimeError(f"expected {len(batch) * OUTPUT_LEN} tokens, got {produced}")
        return elapsed, elapsed - in_model[0]

    mix = [sampling_mix(i) for i in range(NUM_REQUESTS)]
    greedy_s, greedy_host = timed(prompts, greedy)
    sampling_s, sampling_host = timed(prompts, mix)
    single_s, single_host = timed(prompts[:1], greedy)
    return {
        "greedy_s": greedy_s,
        "sampling_s": sampling_s,
        "single_ms_per_token": single_s / OUTPUT_LEN * 1e3,
        "greedy_host_s": greedy_host,
        "sampling_host_s": sampling_host,
        "single_host_ms_per_token": single_host / OUTPUT_LEN * 1e3,
    }


def run_child(python_path: Path, model: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(python_path))
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(model)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"the run with {python_path} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child))))
        return 0
    work = Path(tempfile.mkdtemp(prefix="ferrox-host-overhead-"))
    try:
        model = make_model(work / "model")
        versions = {"current": ROOT / "python"}
        if args.baseline:
            versions = {"baseline": build_baseline(args.baseline, work / "baseline"), **versions}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
        for r in range(args.repeats):
            for name, path in versions.items():
                result = run_child(path, model)
                runs[name].append(result)
                print(
                    f"run {r + 1} {name:>8}: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in result.items())
                )
        print_table(runs)
        if args.json:
            record = {
                "command": " ".join(["python", *sys.argv]),
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "current": current_commit(),
                "baseline": args.baseline,
                "runs": runs,
            }
            Path(args.json).write_text(json.dumps(record, indent=2))
    finally:
        if args.baseline:
            remove_baseline(work / "baseline")
        shutil.rmtree(work, ignore_errors=True)
    return 0


def print_table(runs: dict[str, list[dict[str, float]]]) -> None:
    """Medians with their range; `host` is the time outside the model's forward."""
    groups = [
        ("greedy_s", "greedy_host_s"),
        ("sampling_s", "sampling_host_s"),
        ("single_ms_per_token", "single_host_ms_per_token"),
    ]
    for total_key, host_key in groups:
        print(f"\n{total_key:<22}{'total, median (min-max)':>28}{'host, median (min-max)':>28}")
        for name, results in runs.items():
            cells = []
            for k in (total_key, host_key):
                values = [r[k] for r in results]
                cells.append(
                    f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
                )
            print(f"{name:<22}" + "".join(f"{c:>28}" for c in cells))
        if "baseline" in runs:
            cells = []
            for k in (total_key, host_key):
                pairs = zip(runs["baseline"], runs["current"], strict=True)
                ratios = [b[k] / c[k] for b, c in pairs]
                cells.append(
                    f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                )
            print(f"{'speed-up (base/cur)':<22}" + "".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
