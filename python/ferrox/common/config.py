"""EngineConfig: every engine option in one frozen, validated dataclass.

Option names follow vLLM's where the concept is the same. `"auto"` values are
validated by `EngineConfig.create` without importing torch (a frontend process
that runs no model never loads it); the torch device and dtype they name are
resolved where the engine runs (`ferrox.parallel.device`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.lora import check_lora_options
from ferrox.common.speculative_config import SpeculativeConfig

# dtype names and the torch dtype each stands for
DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# vLLM's --runner and --convert (see engine_args.HELP).
RUNNERS = ("auto", "generate", "pooling")
CONVERSIONS = ("auto", "embed", "none")
# The waiting order: arrival; `priority` then arrival; longest cached prefix
# first (SGLang's `lpm`), a request passed over for 128 steps served first.
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
# How linear weights are held (see loader/model_loader.py): None keeps a GGUF
# file's 4- and 8-bit blocks as stored (CPU) and loads other checkpoints in
# `dtype`; "gguf" says the same of a GGUF file explicitly, and on the CPU
# keeps its Q6_K and Q4_K blocks as stored too (less memory; no faster in
# batches, Q4_K faster at one row with AVX-512 VNNI); "q8_0" / "q4_1"
# quantize every linear layer at load; "none" dequantizes to `dtype`.
QUANTIZATIONS = (None, "gguf", "q8_0", "q4_1", "none")
# What the KV cache holds. "auto": the model's dtype, except float16 on the
# CPU for a model whose linear layers run on 4- and 8-bit blocks (a GGUF
# file's, or quantized at load), as llama.cpp holds its cache; "float16":
# half of a float32 model's cache memory and of the bytes decode attention
# reads (the CPU attention kernels widen it as they read); "float32" keeps
# a float32 model's cache whole.
KV_CACHEDTYPE_NAMES = ("auto", "float32", "float16")
# What a hybrid model's linear-attention layers keep their recurrent matrices
# in (vLLM's and SGLang's option of that name). "auto" and "float32": float32
# (vLLM's "auto" follows the model's dtype; ferrox computes these layers in
# float32 and keeps their state so unless asked); "bfloat16": half the state
# memory a sequence holds and half the state bytes a decode step reads and
# writes, each step's state rounded to 8 bits of mantissa as it is stored.
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
# The CPU KV pool, unless sized explicitly: room for this many tokens or one
# max_model_len sequence, whichever is more, and at least
# CPU_KV_CACHE_MIN_BYTES (a smaller pool saves nothing worth having and makes
# a small model preempt), within CPU_KV_CACHE_MAX_BYTES. A pool whose pages
# cost memory only once written (not zeroed: the CPU attention backend in
# float32) also gets room for CPU_KV_CACHE_TOKENS_PER_SEQ tokens of each of
# max_num_seqs sequences: a batch the scheduler admits whole is not
# preempted for want of blocks while the machine has memory to spare.
CPU_KV_CACHE_TOKENS = 16384
CPU_KV_CACHE_TOKENS_PER_SEQ = 1024
CPU_KV_CACHE_MIN_BYTES = 256 << 20
CPU_KV_CACHE_MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    quantization: str | None = None  # one of QUANTIZATIONS
    device: str = "auto"  # auto: CUDA when available
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own limit
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # one of KV_CACHEDTYPE_NAMES
    mamba_ssm_cache_dtype: str = "auto"  # one of MAMBA_SSM_CACHE_DTYPES
    num_kv_blocks: int | None = None  # fixed pool size, or sized from memory:
    kv_cache_memory_bytes: int | None = None  # ... an explicit budget, or
    gpu_memory_utilization: float = 0.9  # ... this fraction of the GPU
    max_num_seqs: int = 256
    # Requests admitted beyond the running ones; -1: no bound (see engine_args).
    max_queued_requests: int = 1024
    max_num_batched_tokens: int | None = None  # None: max(8192, max_num_seqs)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # Speculative decoding: a dict (or its JSON text) as vLLM takes it; `create`
    # turns it into a SpeculativeConfig.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    max_logprobs: int = 20
    # Ranks a model is split over (see parallel/state.py); rank r of a CUDA
    # engine runs on GPU r.
    tensor_parallel_size: int = 1
    profiler_dir: str | None = None  # enables start_profile / stop_profile
    runner: str = "auto"  # one of RUNNERS
    # Attributes set on the model's Hugging Face config before the model is
    # built (vLLM's --hf-overrides): a dict, or its JSON text.
    hf_overrides: dict[str, Any] | str | None = None
    convert: str = "auto"  # one of CONVERSIONS
    # LoRA adapters (common/lora.py): served only with enable_lora; at most
    # max_loras distinct adapters in a step, of rank at most max_lora_rank;
    # max_cpu_loras (default max_loras) loaded adapters no request uses are
    # kept for later requests, least recently used dropped first.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # One numeric path for every step (layers/cpu_decoder.py): a request's
    # tokens and logprobs do not depend on the batch, chunking or prefix
    # hits. CPU, block-format weights; prefill costs more (docs/performance.md).
    batch_invariant: bool = False
    # Images a prompt may hold (vLLM's limit_mm_per_prompt): {"image": n},
    # or its JSON text; None: no limit.
    limit_mm_per_prompt: dict[str, int] | str | None = None
    # Encoder outputs (image placeholder embeddings, in tokens) kept by
    # image hash for later chunks, preempted requests and repeated images.
    mm_encoder_cache_tokens: int = 16384

    @property
    def max_admitted_requests(self) -> int | None:
        """Requests admitted at once (running and queued); None: no bound."""
        if self.max_queued_requests < 0:
            return None
        return self.max_num_seqs + self.max_queued_requests

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def create(cls, **options: Any) -> EngineConfig:
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise InvalidArgumentError(
                f"unknown engine option(s) {unknown}; valid options are {cls.field_names()}"
            )
        config = cls(**options)
        config = dataclasses.replace(
            config,
            speculative_config=SpeculativeConfig.parse(config.speculative_config),
            hf_overrides=parse_overrides(config.hf_overrides),
            limit_mm_per_prompt=parse_mm_limits(config.limit_mm_per_prompt),
        )
        config.validate()
        return config

    def validate(self) -> None:
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        queued = self.max_queued_requests
        if isinstance(queued, bool) or not isinstance(queued, int) or queued < -1:
            raise InvalidArgumentError(
                f"max_queued_requests must be an int >= -1 (-1: no bound), got {queued!r}"
            )
        optional_positive = {
            "max_model_len": self.max_model_len,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        for name, optional in optional_positive.items():
            if optional is not None and (not isinstance(optional, int) or optional <= 0):
                raise InvalidArgumentError(f"{name} must be a positive integer, got {optional!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise InvalidArgumentError(
                f"block_size must be a power of two up to 128, got {self.block_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise InvalidArgumentError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(
                f"quantization must be one of {QUANTIZATIONS[1:]} (or None), "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHEDTYPE_NAMES:
            raise InvalidArgumentError(
                f"kv_cache_dtype must be one of {KV_CACHEDTYPE_NAMES}, got {self.kv_cache_dtype!r}"
            )
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            why = (
                " (float16's range is too narrow for a recurrent state)"
                if self.mamba_ssm_cache_dtype == "float16"
                else ""
            )
            raise InvalidArgumentError(
                f"mamba_ssm_cache_dtype must be one of {MAMBA_SSM_CACHE_DTYPES}, got "
                f"{self.mamba_ssm_cache_dtype!r}{why}"
            )
        if self.runner not in RUNNERS:
            raise InvalidArgumentError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.convert == "classify":
            raise InvalidArgumentError(
                "convert='classify' is not supported: a causal LM is not turned into a "
                "classifier; load a *ForSequenceClassification checkpoint"
            )
        if self.convert not in CONVERSIONS:
            raise InvalidArgumentError(
                f"convert must be one of {CONVERSIONS}, got {self.convert!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidArgumentError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if not isinstance(self.device, str) or not (
            self.device == "auto" or _DEVICE.fullmatch(self.device)
        ):
            raise InvalidArgumentError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if not isinstance(self.dtype, str) or (
            self.dtype != "auto" and self.dtype not in DTYPE_NAMES
        ):
            raise InvalidArgumentError(
                f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}"
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InvalidArgumentError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if tp > 1:
            if self.speculative_config is not None:
                raise InvalidArgumentError(
                    "speculative decoding does not run with tensor_parallel_size > 1 yet"
                )
            if self.quantization in ("gguf", "q8_0", "q4_1"):
                raise InvalidArgumentError(
                    f"quantization={self.quantization!r} does not run with "
                    "tensor_parallel_size > 1 yet (block-format weights are not sharded)"
                )
            if isinstance(self.device, str) and self.device.startswith("cuda:"):
                raise InvalidArgumentError(
                    "with tensor_parallel_size > 1 give device 'cuda' or 'auto': "
                    "rank r runs on GPU r"
                )
        if self.batch_invariant is not False and self.batch_invariant is not True:
            raise InvalidArgumentError(
                f"batch_invariant must be true or false, got {self.batch_invariant!r}"
            )
        if self.batch_invariant and (tp > 1 or self.enable_lora):
            raise InvalidArgumentError(
                "batch_invariant does not run with "
                + ("tensor_parallel_size > 1" if tp > 1 else "LoRA adapters")
                + " yet: their steps take other numeric paths"
            )
        if self.enable_lora:
            check_lora_options(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            if self.speculative_config is not None:
                raise InvalidArgumentError(
                    "LoRA adapters do not run with speculative decoding (the draft would "
                    "propose the base model's tokens): turn one of them off"
                )
        if self.max_logprobs < 0:
            raise InvalidArgumentError("max_logprobs must be >= 0")
        cache = self.mm_encoder_cache_tokens
        if isinstance(cache, bool) or not isinstance(cache, int) or cache < 0:
            raise InvalidArgumentError(
                f"mm_encoder_cache_tokens must be an integer >= 0, got {cache!r}"
            )
        if not isinstance(self.seed, int):
            raise InvalidArgumentError(f"seed must be an integer, got {self.seed!r}")

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """The parsed speculative config (`create` has parsed it)."""
        spec = self.speculative_config
        return spec if isinstance(spec, SpeculativeConfig) else SpeculativeConfig.parse(spec)

    def batched_tokens_limit(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        limit = max(8192, self.max_num_seqs)
        return limit if self.enable_chunked_prefill else max(limit, max_model_len)


def _from_json(value: Any, name: str) -> Any:
    """An option given as JSON text, parsed; any other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise InvalidArgumentError(f"{name} is not valid JSON: {e}") from e


def parse_mm_limits(value: dict[str, int] | str | None) -> dict[str, int] | None:
    """limit_mm_per_prompt as a dict (from its JSON text), checked: only
    images are taken, at most a non-negative count of them."""
    value = _from_json(value, "limit_mm_per_prompt")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            f'limit_mm_per_prompt must be an object such as {{"image": 4}}, got {value!r}'
        )
    for key, count in value.items():
        if key != "image":
            raise InvalidArgumentError(
                f"limit_mm_per_prompt: ferrox takes images only, not {key!r}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidArgumentError(
                f"limit_mm_per_prompt: the image limit must be an integer >= 0, got {count!r}"
            )
    return dict(value)


def parse_overrides(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """hf_overrides as a dict (from its JSON text), checked."""
    value = _from_json(value, "hf_overrides")
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidArgumentError(
            f"hf_overrides must be a JSON object of config attributes, got {value!r}"
        )
    return value
