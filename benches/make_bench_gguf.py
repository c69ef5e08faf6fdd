"""Random-weight GGUFs for benchmarks, written by llama.cpp's own converter
(`convert_hf_to_gguf.py` of the source `benches/vs_llamacpp.py` builds the
peer from).

    python benches/make_bench_gguf.py                  # Qwen3-MoE, ~0.9B total, ~0.2B active
    python benches/make_bench_gguf.py --family gemma3  # Gemma-3-1B's shape
    python benches/make_bench_gguf.py --family gpt-oss # gpt-oss-20b scaled down
    python benches/make_bench_gguf.py --family qwen3.5 # a Qwen3.5 hybrid, ~0.8B
    python benches/make_bench_gguf.py --quantize Q4_K_M  # then llama-quantize's Q4_K_M of it
    python benches/make_bench_gguf.py --layers 4 --checkpoint-only DIR  # the checkpoint alone
    python benches/vs_llamacpp.py --model \
        ~/.cache/ferrox/bench-models/qwen3-moe-0.9b-a0.2b.q8_0.gguf

`qwen3-moe` scales Qwen3-30B-A3B down (hidden 1024, 16 layers, 64 experts of
width 256, 8 a token, 16 query and 4 KV heads of 128): about 0.9B parameters
of which 0.2B are active per token. `gemma3` has Gemma-3-1B's shape (hidden
1152, 26 layers, 4 query heads and 1 KV head of 256, MLP 6912, five local
layers with a 512-token window to one global). `gpt-oss` scales gpt-oss-20b
down (hidden 1024, 12 layers alternating a 128-token window and full
attention, 16 query and 4 KV heads of 64 with sinks, 32 experts of width 512,
4 a token): about 0.74B parameters, 0.2B active. `qwen3.5` is the hybrid of
`benches/hybrid_models.py --shape 0.8b` (hidden 1024, 24 layers: 18 Gated
DeltaNet and 6 attention). All use the bundled model's
49152-token BPE vocabulary (llama.cpp's converter only takes a tokenizer it
knows). The weights are N(0, 0.02), norms one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_llamacpp import ensure_server, peer_dir


def build_checkpoint(out: Path, args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, Qwen3MoeConfig

    from ferrox.model_files import default_model_path
    from ferrox.model_files.gguf_reader import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if args.family == "qwen3.5":
        from transformers import Qwen3_5TextConfig

        from hybrid_models import SHAPES

        config = Qwen3_5TextConfig(
            architectures=["Qwen3_5ForCausalLM"],
            linear_conv_kernel_dim=4,
            **SHAPES["0.8b"],
            **common,
        )
    elif args.family == "gpt-oss":
        config = GptOssConfig(
            hidden_size=1024,
            intermediate_size=512,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            **(common | {"tie_word_embeddings": False}),
        )
    elif args.family == "gemma3":
        config = Gemma3TextConfig(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
            ],
            **common,
        )
    else:
        config = Qwen3MoeConfig(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            moe_intermediate_size=args.expert_width,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim,
            num_experts=args.experts,
            num_experts_per_tok=args.experts_per_token,
            norm_topk_prob=True,
            **common,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    total = sum(p.numel() for p in model.parameters())
    active = total
    if args.family == "qwen3-moe":
        expert = 3 * args.hidden * args.expert_width
        active -= args.layers * (args.experts - args.experts_per_token) * expert
    elif args.family == "gpt-oss":
        active -= 12 * (32 - 4) * 3 * 1024 * 512
    print(f"{total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active a token", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    settings = out / "tokenizer_config.json"
    options = json.loads(settings.read_text())
    options["tokenizer_class"] = "GPT2Tokenizer"  # what the converter looks for
    settings.write_text(json.dumps(options))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    families = ("qwen3-moe", "gemma3", "gpt-oss", "qwen3.5")
    parser.add_argument("--family", choices=families, default="qwen3-moe")
    parser.add_argument("--hidden", type=int, default=1024, help="(qwen3-moe's shape)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--experts-per-token", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--outtype", default="q8_0", help="the converter's --outtype")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--quantize",
        metavar="TYPE",
        help="also write llama-quantize's TYPE (Q4_K_M, ...) of the converted file beside it",
    )
    parser.add_argument(
        "--checkpoint-only",
        type=Path,
        metavar="DIR",
        help="write the random-weight transformers checkpoint to DIR and stop (no llama.cpp)",
    )
    args = parser.parse_args()
    if args.checkpoint_only:
        build_checkpoint(args.checkpoint_only, args)
        print(f"wrote {args.checkpoint_only}")
        return
    from ferrox.model_files.default import cache_dir

    name = {
        "qwen3-moe": "qwen3-moe-0.9b-a0.2b",
        "gemma3": "gemma3-1b-shape",
        "gpt-oss": "gpt-oss-0.7b-a0.2b",
        "qwen3.5": "qwen3.5-0.8b-shape",
    }[args.family]
    out = args.out or cache_dir() / "bench-models" / f"{name}.{args.outtype}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    server = ensure_server()  # unpacks the vendored llama.cpp source (and builds the peer)
    source = next((peer_dir() / "src").glob("*/vendor/llama.cpp"))
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        build_checkpoint(Path(tmp), args)
        env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
        subprocess.run(
            [sys.executable, str(source / "convert_hf_to_gguf.py"), tmp,
             "--outfile", str(out), "--outtype", args.outtype,
             *(["--no-mtp"] if args.family == "qwen3.5" else [])],
            check=True, env=env,
        )  # fmt: skip
    print(f"wrote {out}")
    if args.quantize:
        quantized = out.with_name(f"{name}.{args.quantize.lower()}.gguf")
        bin_dir = server.parent  # the peer's build: its tools and libraries
        # (cmake as the peer's build ran it: from pip, beside this Python)
        path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        build = ["cmake", "--build", str(bin_dir.parent), "--target", "llama-quantize"]
        subprocess.run(build, check=True, env=dict(os.environ, PATH=path))
        env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
        subprocess.run(
            [str(bin_dir / "llama-quantize"), "--allow-requantize", str(out), str(quantized),
             args.quantize],
            check=True, env=env,
        )  # fmt: skip
        print(f"wrote {quantized}")


if __name__ == "__main__":
    main()
