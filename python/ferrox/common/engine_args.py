"""Command-line flags for every EngineConfig option, generated from the
dataclass so that the CLI and the Python API never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from ferrox.common.config import EngineConfig

HELP = {
    "model": "Hugging Face model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory, when it differs from the model's",
    "load_format": "auto | safetensors | gguf | dummy (random weights, for benchmarks)",
    "dtype": "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16",
    "tensor_parallel_size": "ranks (processes; GPUs on CUDA) the model is split over",
    "quantization": "how linear weights are held: by default a GGUF file's Q4_0 / Q4_1 / Q8_0 "
    "blocks are kept and run by the CPU block kernels (CPU, float32), other weights load in "
    "--dtype; gguf: keep a GGUF file's blocks (also on a GPU, Triton kernel; on the CPU its "
    "Q6_K and Q4_K as stored too, in less memory than Q8_0 and Q4_1 and no faster in "
    "batches), refused where "
    "they cannot run; q8_0 | q4_1: quantize every linear layer at load (CPU float32, or a "
    "GPU); none: dequantize to --dtype",
    "device": "auto (CUDA when available) | cpu | cuda",
    "seed": "random seed of the engine",
    "max_model_len": "context length (default: the model's)",
    "block_size": "tokens per KV-cache block",
    "kv_cache_dtype": "auto (the model's dtype) | float16: half the cache memory of a float32 "
    "model and half the bytes decode attention reads (CPU attention backend; on a GPU only "
    "for a float16 model)",
    "mamba_ssm_cache_dtype": "auto (float32) | float32 | bfloat16: what a hybrid model's "
    "linear-attention layers (Qwen3.5, Qwen3-Next) keep their recurrent state in; bfloat16 "
    "halves a sequence's state memory and the state bytes a decode step moves, and rounds "
    "the state at each step",
    "num_kv_blocks": "fixed KV-cache size in blocks (overrides the memory-based sizing)",
    "kv_cache_memory_bytes": "KV-cache memory budget in bytes",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "max_num_seqs": "most requests running at once",
    "max_queued_requests": "requests admitted beyond --max-num-seqs running ones; past that the "
    "server answers 503 with Retry-After at once and LLM.generate feeds the engine as requests "
    "finish (-1: no bound)",
    "max_num_batched_tokens": "token budget of one step (prefill chunks plus decodes)",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts over several steps",
    "scheduling_policy": "fcfs | priority (lower `priority` values first) | lpm (longest "
    "cached prefix first, a request passed over served first after 128 steps)",
    "attention_backend": "auto | cpu | torch | triton | flash-attn",
    "enforce_eager": "never capture CUDA graphs",
    "batch_invariant": "one numeric path for every step on the CPU: a request's tokens and "
    "logprobs are the same whatever else runs, chunked or with a prefix hit (block-format "
    "weights; long prompts prefill slower)",
    "speculative_config": 'speculative decoding, as JSON: {"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or '
    '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; optional '
    '"disable_by_batch_size", and "adaptive" (default true: draft lengths from measured '
    "acceptance and step cost)",
    "max_logprobs": "largest logprobs / top_logprobs a request may ask for",
    "hf_overrides": "attributes set on the model's config before it is built, as JSON: "
    '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", '
    '"yes"], "is_original_qwen3_reranker": true} serves Qwen3-Reranker as a cross-encoder',
    "runner": "auto | generate (refuse a checkpoint that cannot generate) | pooling (serve "
    "embeddings, classification and scores; generation requests are refused)",
    "convert": "auto | embed (a causal LM's pooling requests embed: its last token's final "
    "hidden state) | none (only a checkpoint made for pooling, a base model or a classifier, "
    "serves them)",
    "enable_lora": "serve LoRA adapters (--lora-modules; LLM.generate(lora_request=...))",
    "max_loras": "most distinct LoRA adapters in one step",
    "max_lora_rank": "largest LoRA rank an adapter may have",
    "max_cpu_loras": "loaded LoRA adapters kept when no request uses them, least recently used "
    "dropped first (default: --max-loras)",
    "limit_mm_per_prompt": 'images a prompt may hold, as JSON: {"image": 4} (default: no '
    "limit; a vision-language model only)",
    "mm_encoder_cache_tokens": "image encoder outputs kept by image hash, in placeholder "
    "tokens, for a prompt's later chunks, preempted requests and repeated images",
    "profiler_dir": "enable the torch profiler (LLM.start_profile / stop_profile, the server's "
    "POST /start_profile and /stop_profile); traces are written to this folder",
}


def _base_type(annotation: Any) -> type:
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {**typing.__dict__, "torch": None})
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name not in EngineConfig.field_names():
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = (flag, "-tp") if f.name == "tensor_parallel_size" else (flag,)
        # JSON text, parsed by EngineConfig.create.
        json_text = f.name in ("speculative_config", "hf_overrides", "limit_mm_per_prompt")
        kind = str if json_text else _base_type(f.type)
        help_text = f"{HELP.get(f.name, '')} (default: {f.default})"
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            group.add_argument(*flags, type=kind, default=f.default, help=help_text)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in EngineConfig.field_names()}
