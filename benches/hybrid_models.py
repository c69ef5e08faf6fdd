"""Hybrid models (Qwen3.5: Gated DeltaNet linear attention beside attention
layers) on random weights: the state a sequence holds, decode speed at 1
and 16 streams, and a shared-prefix workload with and without prefix
caching (the cache resumes such a model from state snapshots).

    python benches/hybrid_models.py [--repeats 3] [--shape small|0.8b] [--json FILE]

`--shape small` (default): hidden 512, 12 layers (9 linear, 3 attention),
8 query / 2 KV heads of 128, 8 linear key and value heads of 64, MLP 1536;
`0.8b`: hidden 1024, 24 layers (18 linear, 6 attention), 8 query / 2 KV
heads of 256, 16 linear key and value heads of 128, MLP 3584. Both with the
bundled model's vocabulary and tokenizer, float32 weights.

- state: one sequence's recurrent state (all linear layers) against the KV
  one token adds in the attention layers, and a sequence's whole footprint
  at 8k tokens against a full-attention model of the same layers;
- decode: output tok/s of 1 and of 16 greedy streams (64-token prompts, 128
  new tokens), ferrox and, for 1 stream, transformers' `generate` on the
  same weights;
- shared prefix: 16 requests that share a `--prefix-tokens` prefix (2,048
  by default) with 16 tokens of their own, submitted together, 8 new tokens
  each: median and max time to first token, prefix caching off and on (a
  fresh prefix each repeat, the cache reset before).
Prints medians (min-max) over the repeats and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrox import LLM, SamplingParams  # isort: skip  (before torch)
import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_description

SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(
        hidden_size=512,
        num_hidden_layers=12,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
    "0.8b": dict(
        hidden_size=1024,
        num_hidden_layers=24,
        intermediate_size=3584,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
}


def build_model(path: Path, shape: str) -> Path:
    """A Qwen3.5 text model of `shape` with random weights, saved with the
    bundled model's tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from ferrox import EngineConfig
    from ferrox.model_files.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(EngineConfig.create())
    config = Qwen3_5TextConfig(
        architectures=["Qwen3_5ForCausalLM"],
        vocab_size=len(tokenizer),
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        linear_conv_kernel_dim=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def decode_rate(llm: LLM, streams: int, vocab: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (64,), generator=gen).tolist()}
               for _ in range(streams)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


@torch.inference_mode()
def transformers_rate(path: Path, vocab: int, seed: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, 64), generator=gen)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
    return (out.shape[1] - 64) / (time.perf_counter() - start)


def shared_prefix_ttft(llm: LLM, prefix_tokens: int, vocab: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (prefix_tokens,), generator=gen).tolist()
    prompts = [
        {"prompt_token_ids": prefix + torch.randint(3, vocab, (16,), generator=gen).tolist()}
        for _ in range(16)
    ]
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        o.metrics.first_token_time - o.metrics.arrival_time
        for o in outputs
        if o.metrics is not None and o.metrics.first_token_time is not None
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    figures: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip(),
        "cpu": cpu_description(),
        "shape": args.shape,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "qwen3.5", args.shape)
        max_len = args.prefix_tokens + 64
        cached = LLM(str(path), max_num_seqs=16, max_model_len=max_len)
        groups = cached.engine.runner.kv_groups
        vocab = cached.engine.vocab_size
        kv_per_token = 2 * len(groups.full_layers) * groups.num_kv_heads * groups.head_dim * 4
        layers = len(groups.full_layers) + len(groups.state_layers)
        state = groups.state_bytes
        figures["state_bytes"] = state
        figures["kv_bytes_per_token"] = kv_per_token
        at_8k = state + 8192 * kv_per_token
        full_8k = 8192 * kv_per_token * layers // len(groups.full_layers)
        decode: dict[str, list[float]] = {"ferrox_1": [], "ferrox_16": [], "transformers_1": []}
        ttft: dict[str, list[float]] = {"off": [], "on": [], "off_max": [], "on_max": []}
        uncached = LLM(str(path), max_num_seqs=16, max_model_len=max_len,
                       enable_prefix_caching=False)  # fmt: skip
        decode_rate(cached, 2, vocab, 99)  # warm up
        for r in range(args.repeats):
            decode["ferrox_1"].append(decode_rate(cached, 1, vocab, r))
            decode["ferrox_16"].append(decode_rate(cached, 16, vocab, r))
            decode["transformers_1"].append(transformers_rate(path, vocab, r))
            for name, llm in (("off", uncached), ("on", cached)):
                times = shared_prefix_ttft(llm, args.prefix_tokens, vocab, 1000 + r)
                ttft[name].append(statistics.median(times))
                ttft[f"{name}_max"].append(max(times))
        figures["decode_tok_s"] = decode
        figures["shared_prefix_ttft_s"] = ttft
    cpu = figures["cpu"]
    print(f"CPU: {cpu}")
    print(f"shape {args.shape}: {layers} layers, {len(groups.state_layers)} linear")
    print(f"state per sequence: {state / 2**20:.2f} MiB; attention KV per token: "
          f"{kv_per_token / 2**10:.1f} KiB")  # fmt: skip
    print(f"one sequence at 8k tokens: {at_8k / 2**20:.1f} MiB, the same layers all attention: "
          f"{full_8k / 2**20:.1f} MiB ({at_8k / full_8k:.2f}x)")  # fmt: skip
    for name, values in decode.items():
        print(f"decode {name}: {spread(values)} tok/s")
    ratio_1 = [f / t for f, t in zip(decode["ferrox_1"], decode["transformers_1"], strict=True)]
    print(f"1 stream, ferrox / transformers: {spread(ratio_1)}x")
    print(f"shared prefix ({args.prefix_tokens} tokens, 16 requests together), TTFT s:")
    for name in ("off", "on"):
        worst = spread(ttft[name + "_max"])
        print(f"  prefix caching {name}: median {spread(ttft[name])}, max {worst}")
    gains = [off / on for off, on in zip(ttft["off"], ttft["on"], strict=True)]
    print(f"  median TTFT off / on: {spread(gains)}x")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
