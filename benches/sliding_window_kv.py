"""KV memory a long sequence holds, and decode speed, for a model with
sliding-window layers (Gemma 3's five local layers to one global), side by
side with the same model whose every layer attends globally.

    python benches/sliding_window_kv.py                  # 8k context, window 512
    python benches/sliding_window_kv.py --context 4096 --repeats 3

Random weights, built locally from a transformers Gemma 3 config (Gemma-3-1B's
window and layer pattern, a smaller width so that an 8k-token prefill runs on a
laptop CPU). One request: an 8k-token prompt, then `--decode` tokens. Printed:
the KV bytes the sequence holds while it decodes at the end of its context,
split by layer kind (read from the scheduler's tables), against what full
attention holds for the same layers; and the decode rate of both models.
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

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_description


def build(path: Path, args: argparse.Namespace, windowed: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    kinds = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(args.layers)
    ]
    config = Gemma3TextConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=args.hidden // 4,
        query_pre_attn_scalar=args.hidden // 4,
        max_position_embeddings=args.context + args.decode + 16,
        layer_types=kinds if windowed else ["full_attention"] * args.layers,
        sliding_window=args.window,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def run(path: Path, args: argparse.Namespace) -> dict[str, float]:
    import numpy as np

    from ferrox import LLM, SamplingParams

    llm = LLM(
        str(path),
        max_num_seqs=1,
        max_num_batched_tokens=args.chunk,
        block_size=16,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    runner = engine.runner
    prompt = np.random.default_rng(0).integers(2, 4000, args.context).tolist()
    params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
    engine.add_request("long", prompt, params)
    groups = runner.kv_groups
    per_token = 2 * groups.num_kv_heads * groups.head_dim * runner.kv_dtype.itemsize
    held: tuple[int, int] = (0, 0)
    decode_start = None
    decoded = 0
    while engine.has_unfinished_requests():
        engine.step()
        info = engine.scheduler.request_info(0)
        if info is None or info["num_computed_tokens"] < args.context:
            continue
        if decode_start is None:
            decode_start, decoded = time.perf_counter(), info["num_tokens"] - args.context
        held = (info["num_blocks"], info["num_window_blocks"])
        decoded_now = info["num_tokens"] - args.context
    assert decode_start is not None
    seconds = time.perf_counter() - decode_start
    blocks, window_blocks = held
    bs = 16
    return {
        "full_layers": len(groups.full_layers),
        "window_layers": len(groups.window_layers),
        "full_layer_bytes": blocks * bs * per_token * len(groups.full_layers),
        "window_layer_bytes": window_blocks * bs * per_token * len(groups.window_layers),
        # The same window layers under full attention: every block.
        "window_layers_as_full_bytes": blocks * bs * per_token * len(groups.window_layers),
        "decode_tok_s": (decoded_now - decoded) / seconds if seconds > 0 else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        windowed = build(Path(tmp) / "windowed", args, windowed=True)
        full = build(Path(tmp) / "full", args, windowed=False)
        runs = [(run(windowed, args), run(full, args)) for _ in range(args.repeats)]
    w, f = runs[-1]
    mib = 1 << 20
    held = w["full_layer_bytes"] + w["window_layer_bytes"]
    full_held = f["full_layer_bytes"]
    print(f"CPU: {cpu_description()}")
    print(
        f"context {args.context}, window {args.window}: {w['window_layers']} window layers, "
        f"{w['full_layers']} global"
    )
    print(
        f"  window layers hold {w['window_layer_bytes'] / mib:.2f} MiB, under full attention "
        f"{w['window_layers_as_full_bytes'] / mib:.2f} MiB: "
        f"{w['window_layer_bytes'] / w['window_layers_as_full_bytes']:.4f} "
        f"(window / context = {args.window / args.context:.4f})"
    )
    print(
        f"  the whole sequence holds {held / mib:.2f} MiB, the all-global model "
        f"{full_held / mib:.2f} MiB: {held / full_held:.3f}x"
    )
    rates = [(a["decode_tok_s"], b["decode_tok_s"]) for a, b in runs]
    ratios = [a / b for a, b in rates]
    print(
        "  decode at the end of the context: "
        + ", ".join(f"{a:.1f} vs {b:.1f} tok/s" for a, b in rates)
        + f"; ratio median {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f})"
    )
    if args.json:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()  # fmt: skip
        record = {
            "command": " ".join(sys.argv), "commit": commit, "cpu": cpu_description(),
            "args": vars(args) | {"json": None}, "runs": runs,
        }  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
