"""Tiny random models of each family written to GGUF by llama.cpp's own
converter (`convert_hf_to_gguf.py` of the source `benches/vs_llamacpp.py`
builds the peer from), loaded by ferrox and compared with transformers on
the same weights: greedy tokens equal, logprobs close. The test suite checks
the same families against synthetic GGUF files in llama.cpp's layout
(tests/gguf_files.py); this is the check against the converter itself,
which the tests cannot run (it needs the vendored source).

    python benches/converter_roundtrip.py                 # every family below
    python benches/converter_roundtrip.py --family gpt-oss
    python benches/converter_roundtrip.py --source DIR    # an unpacked vendor/llama.cpp

The converter imports `sentencepiece` for Llama-family vocabularies
(`pip install sentencepiece`).
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
sys.path.insert(0, str(Path(__file__).parent.parent))
from vs_llamacpp import ensure_server, peer_dir

# family (tests/models.py's tiny spec) -> overrides for the converter's sake
FAMILIES = {
    "gpt-oss": {"swiglu_limit": 7.0},  # (llama.cpp's graph fixes the clamp at 7)
    # (the files record neither the score scale nor a pattern other than
    # llama.cpp's: five local layers to one global, the scale head_dim)
    "gemma3-window": {
        "query_pre_attn_scalar": 16,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
    "qwen3-moe": {"norm_topk_prob": True},  # (llama.cpp's qwen3moe graph renormalises)
    "qwen2-moe": {"mlp_only_layers": []},  # (llama.cpp's graph makes every layer sparse)
    # (Mistral's window is not in llama.cpp's files: they run as full attention)
    "llama-gqa-tied": {},
    "phi3": {},
    "granite": {},
    "qwen3.5": {},
    "qwen3.5-moe": {},
    # (llama.cpp's qwen3next graph makes every layer sparse and renormalises)
    "qwen3-next": {"mlp_only_layers": [], "norm_topk_prob": True},
}
# Families whose converter expects a multi-token-prediction head unless told
# there is none (the tiny models have none).
WITHOUT_MTP = {"qwen3.5", "qwen3.5-moe", "qwen3-next"}
TOKENIZER_BY_MODEL_TYPE = {"qwen3.5-moe": "qwen3_5_text"}


def roundtrip(family: str, overrides: dict, root: Path, source_dir: Path) -> bool:
    import torch
    from tests import models
    from transformers import AutoModelForCausalLM

    from ferrox import LLM, SamplingParams
    from ferrox.model_files import default_model_path
    from ferrox.model_files.gguf_reader import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())  # (a tokenizer the converter knows)
    config_class, spec = models.TINY_SPECS[family]
    config = config_class(
        **{
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.25,
            **spec,
            **overrides,
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_dir, gguf = root / family, root / f"{family}.gguf"
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    settings = hf_dir / "tokenizer_config.json"
    options = json.loads(settings.read_text())
    options["tokenizer_class"] = "GPT2Tokenizer"  # what the converter looks for
    settings.write_text(json.dumps(options))
    if family in TOKENIZER_BY_MODEL_TYPE:
        # transformers picks these model types' own tokenizer class whatever
        # tokenizer_config says; the converter then does not recognise the
        # bundled vocabulary: let it load the tokenizer as the dense model's.
        config_file = hf_dir / "config.json"
        saved = config_file.read_text()
        hf_config = json.loads(saved)
        hf_config["model_type"] = TOKENIZER_BY_MODEL_TYPE[family]
        config_file.write_text(json.dumps(hf_config))
    env = dict(os.environ, PYTHONPATH=str(source_dir / "gguf-py"))
    converted = subprocess.run(
        [sys.executable, str(source_dir / "convert_hf_to_gguf.py"), str(hf_dir),
         "--outfile", str(gguf), "--outtype", "f32",
         *(["--no-mtp"] if family in WITHOUT_MTP else [])],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if converted.returncode != 0:
        print(f"{family}: the converter failed:\n{converted.stderr[-2000:]}")
        return False
    if family in TOKENIZER_BY_MODEL_TYPE:
        config_file.write_text(saved)  # (transformers reads the model as it is)
    hf = models.hf_model(hf_dir)
    llm = LLM(str(gguf), num_kv_blocks=64, block_size=4)
    prompts = [list(range(100, 105)), list(range(300, 340))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    ok = True
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        expected, expected_lp = models.hf_greedy(hf, prompt, 8)
        tokens = out.outputs[0].token_ids
        got = out.outputs[0].logprobs
        drift = float("inf")
        if tokens == expected:
            pairs = zip(got, tokens, expected_lp, strict=True)
            drift = max(abs(lp[t].logprob - e) for lp, t, e in pairs)
        ok &= drift < 1e-3
        print(f"{family}: prompt of {len(prompt)}: tokens equal {tokens == expected}, "
              f"largest logprob difference {drift:.2e}")  # fmt: skip
    llm.engine.close()
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), action="append")
    parser.add_argument(
        "--source", type=Path, default=None, help="vendor/llama.cpp of the unpacked sdist"
    )
    args = parser.parse_args()
    source_dir = args.source
    if source_dir is None:
        ensure_server()  # unpacks the vendored llama.cpp source (and builds the peer)
        source_dir = next((peer_dir() / "src").glob("*/vendor/llama.cpp"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family or sorted(FAMILIES):
            results[family] = roundtrip(family, FAMILIES[family], Path(tmp), source_dir)
    print(
        "all equal"
        if all(results.values())
        else f"failed: {[f for f, ok in results.items() if not ok]}"
    )
    sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
