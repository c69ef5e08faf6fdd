"""Multi-LoRA serving: 16 streams over 8 adapters against 16 streams of the
base model alone, same engine, same run.

    python benches/lora_streams.py [--repeats 3] [--adapters 8] [--rank 16]
        [--targets all|attention] [--shape llama-1b] [--json FILE]

The bundled model (its GGUF blocks) by default, or with `--shape llama-1b`
a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 query and 8 KV
heads, MLP 8192, the bundled model's vocabulary and tokenizer) with random
weights quantized to Q8_0 at load, with random LoRA adapters in PEFT's format on every
projection (`all`: q/k/v/o, gate/up/down) or on attention's (`attention`:
q/k/v/o), written to a temporary directory. Each repeat runs both
workloads, alternating: N greedy requests of a 64-token prompt and 128
output tokens (EOS ignored, prefix caching off), all submitted at once; with
adapters, request i runs under adapter i mod A.
Prints output tok/s of each (median, min-max) and the ratio.
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

from ferrox import LLM, LoRARequest, SamplingParams  # isort: skip  (before torch)
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_description

PROMPT_TOKENS = 64
NEW_TOKENS = 128
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(path: Path, llm: LLM, rank: int, seed: int, targets: str = "all") -> Path:
    """A random adapter for the loaded model's shapes."""
    shapes = llm.engine.runner.lora.targets  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for group, names in MODULES.items():
            if targets == "attention" and group == "mlp":
                continue
            for name in names:
                fan_in, fan_out = shapes.modules[name]
                prefix = f"base_model.model.model.layers.{layer}.{group}.{name}"
                a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                b = torch.randn(fan_out, rank, generator=gen) * 0.02
                tensors[f"{prefix}.lora_A.weight"] = a
                tensors[f"{prefix}.lora_B.weight"] = b
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def llama_1b_shape(path: Path) -> Path:
    """A Hugging Face directory: Llama-3.2-1B's shape (tied embeddings) with
    the bundled model's vocabulary and tokenizer; its weights come random."""
    from transformers import LlamaConfig

    from ferrox import EngineConfig
    from ferrox.model_files.tokenizer import load_tokenizer

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(path)
    load_tokenizer(EngineConfig.create()).save_pretrained(path)
    return path


def timed(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--targets", choices=["all", "attention"], default="all")
    parser.add_argument("--shape", choices=["llama-1b"], help="a random-weight model instead")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = tempfile.TemporaryDirectory()
    model, extra = None, {}
    if args.shape == "llama-1b":
        model = str(llama_1b_shape(Path(work.name) / "llama-1b"))
        extra = dict(load_format="dummy", quantization="q8_0")
    llm = LLM(
        model,
        **extra,
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        max_num_seqs=args.streams,
        enable_prefix_caching=False,
    )
    prompts = [[1, *range(1000 + 97 * i, 1000 + 97 * i + PROMPT_TOKENS - 1)]
               for i in range(args.streams)]  # fmt: skip
    with work as tmp:
        loras = [
            LoRARequest(
                f"a{i}",
                i + 1,
                str(write_adapter(Path(tmp) / f"a{i}", llm, args.rank, i, args.targets)),
            )
            for i in range(args.adapters)
        ]
        mixed = [loras[i % args.adapters] for i in range(args.streams)]
        base: list[LoRARequest | None] = [None] * args.streams
        timed(llm, prompts[:2], base[:2])  # warm-up, and the adapters loaded once
        timed(llm, prompts[: args.adapters], mixed[: args.adapters])
        runs: dict[str, list[float]] = {"base": [], "adapters": []}
        for _ in range(args.repeats):
            runs["base"].append(timed(llm, prompts, base))
            runs["adapters"].append(timed(llm, prompts, mixed))
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    print(f"{args.shape or 'bundled model'}: {args.streams} streams, {args.adapters} adapters "
          f"of rank {args.rank} on {args.targets} projections, "
          f"{PROMPT_TOKENS}-token prompts, {NEW_TOKENS} tokens each")  # fmt: skip
    for name, values in runs.items():
        print(f"  {name:9s} {statistics.median(values):7.1f} tok/s "
              f"(min {min(values):.1f}, max {max(values):.1f})")  # fmt: skip
    ratios = [a / b for a, b in zip(runs["adapters"], runs["base"], strict=True)]
    print(f"  adapters / base: {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")  # fmt: skip
    if args.json:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        record = {
            "commit": commit,
            "cpu": cpu,
            "command": "python " + " ".join(sys.argv),
            "runs": runs,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
