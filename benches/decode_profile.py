"""Where a single-stream decode token's time goes on the CPU, for any GGUF
(default the bundled model; `benches/make_bench_gguf.py` makes an MoE one).

    python benches/decode_profile.py [--model FILE] [--prompt-len 256] [--new-tokens 128]

Generates greedily once to warm up, then once under cProfile, and prints
per decoded token the milliseconds in each native call (the fused decoder
layers, a hybrid's fused linear-attention layers, the native MoE blocks,
the block matmuls: the LM head), the rest, and the bytes of weights each
kind reads per second.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from ferrox import LLM, SamplingParams  # isort: skip  (before torch: see docs/performance.md)
import torch

from ferrox.layers.moe import SparseMoe
from ferrox.layers.quant_linear import QuantLinear

CALLS = {
    "fused decoder layers": "{method 'forward' of 'ferrox._native.CpuDecoderLayer' objects}",
    "fused linear-attention layers": (
        "{method 'forward' of 'ferrox._native.CpuGatedDeltaLayer' objects}"
    ),
    "native MoE blocks": "{method 'forward' of 'ferrox._native.CpuMoeExperts' objects}",
    "block matmuls (LM head)": "{built-in method ferrox._native.quant_matmul_cpu}",
}


def _weight_bytes(model: torch.nn.Module) -> dict[str, float]:
    """Bytes of weights each kind of call reads per decoded token."""
    layers = list(model.layers)

    def block_bytes(modules: list[object]) -> int:
        return sum(m.weight.numel() for m in modules if isinstance(m, QuantLinear))

    # (a dense MLP's projections are read inside the fused layer too)
    attention, linear = 0, 0
    for layer in layers:
        mlp = [getattr(layer.mlp, "gate_up_proj", None), getattr(layer.mlp, "down_proj", None)]
        if getattr(layer, "linear", False):  # a hybrid's Gated DeltaNet layer
            mixer = layer.linear_attn
            projections = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
            linear += block_bytes([*(getattr(mixer, name) for name in projections), *mlp])
        else:
            attention += block_bytes([layer.self_attn.qkv_proj, layer.self_attn.o_proj, *mlp])
    experts = 0.0
    for layer in layers:
        if isinstance(layer.mlp, SparseMoe):
            expert = layer.mlp.experts[0]
            per = expert.gate_up_proj.weight.numel() + expert.down_proj.weight.numel()
            experts += per * layer.mlp.top_k
    head = model.lm_head.weight.numel() if isinstance(model.lm_head, QuantLinear) else 0
    return {
        "fused decoder layers": attention,
        "fused linear-attention layers": linear,
        "native MoE blocks": experts,
        "block matmuls (LM head)": head,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    options = {"model": str(args.model.expanduser())} if args.model else {}
    llm = LLM(enable_prefix_caching=False, **options)
    ids = [1000 + i % 3000 for i in range(args.prompt_len)]
    prompt = [{"prompt_token_ids": ids}]
    first = SamplingParams(max_tokens=1, temperature=0.0)
    whole = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, whole, use_tqdm=False)  # warm-up
    prefill_profile = cProfile.Profile()
    start = time.perf_counter()
    prefill_profile.enable()
    llm.generate(prompt, first, use_tqdm=False)
    prefill_profile.disable()
    prefill = time.perf_counter() - start
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    llm.generate(prompt, whole, use_tqdm=False)
    profile.disable()
    decode = (time.perf_counter() - start - prefill) / args.new_tokens
    # The decode's calls: the whole run's less the prefill's (profiled alone).
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    before = pstats.Stats(prefill_profile).stats  # type: ignore[attr-defined]
    seconds = {pstats.func_std_string(f): v[2] for f, v in stats.items()}
    for f, v in before.items():
        key = pstats.func_std_string(f)
        seconds[key] = seconds.get(key, 0.0) - v[2]
    weights = _weight_bytes(llm.engine.runner.model)
    print(f"decode {decode * 1e3:.2f} ms a token (profiled), prefill {prefill:.2f} s")
    accounted = 0.0
    for label, key in CALLS.items():
        per_token = seconds.get(key, 0.0) / args.new_tokens
        accounted += per_token
        rate = weights[label] / per_token / 1e9 if per_token else 0.0
        print(f"  {label:<30}{per_token * 1e3:7.2f} ms  ({rate:5.1f} GB/s of weights)")
    print(f"  {'the rest':<30}{(decode - accounted) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
