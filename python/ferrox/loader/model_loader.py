"""Resolves `EngineConfig.model` / `load_format` to a config, weights on the
device and a tokenizer: a Hugging Face directory (safetensors), a GGUF file,
random weights (`dummy`), or the bundled default model."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from ferrox.common.config import EngineConfig, parse_overrides
from ferrox.common.errors import InvalidArgumentError, ModelLoadError
from ferrox.layers import quant_linear
from ferrox.layers.attention import get_attention_backend
from ferrox.layers.cpu_linear import linear_layers, pack_linear_layers
from ferrox.layers.quant_linear import (
    KERNEL_FORMATS,
    STORED_FORMATS,
    QuantEmbedding,
    QuantLinear,
    dequantize,
)
from ferrox.loader.gguf import load_gguf
from ferrox.loader.gguf_dequant import BlockTensor, q4_k_as_q4_1, requantized
from ferrox.model_files.hub import resolve_model_path
from ferrox.models.base import CausalLM
from ferrox.models.registry import resolve_model_class
from ferrox.parallel.device import torch_device, torch_dtype


@dataclass
class LoadedModel:
    hf_config: PretrainedConfig
    model: CausalLM
    tokenizer: Any | None  # a PreTrainedTokenizerFast, or None (token ids only)
    eos_token_ids: list[int]
    source: str
    load_seconds: float


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 4096
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    uses_window = getattr(hf_config, "use_sliding_window", True)
    capped = bool(window and uses_window and window < model_max) and not windows_implemented(
        config, hf_config
    )
    if capped:
        # This backend does not implement sliding windows: stay inside the window.
        model_max = window
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        why = (
            f"the model's sliding window of {model_max} tokens (the "
            f"{config.attention_backend!r} attention backend does not implement sliding "
            "windows, so the context stays inside the window)"
            if capped
            else f"the model's limit of {model_max}"
        )
        raise InvalidArgumentError(f"max_model_len={config.max_model_len} exceeds {why}")
    return config.max_model_len


def windows_implemented(config: EngineConfig, hf_config: Any) -> bool:
    """Whether the model's sliding-window layers run as such (the family and
    the attention backend both implement windows)."""
    backend = get_attention_backend(config.attention_backend, torch_device(config))
    family = resolve_model_class(hf_config)
    return backend.supports_sliding_window and family.implements_sliding_window


def load_model(config: EngineConfig) -> LoadedModel:
    start = time.perf_counter()
    path = resolve_model_path(config.model)
    fmt = config.load_format
    if fmt == "auto":
        fmt = "gguf" if path.suffix == ".gguf" else "safetensors"
    quantize_to = _check_quantization(config, fmt)
    tokenizer = None
    plan: dict[str, str] = {}
    if fmt == "gguf" or (fmt == "dummy" and path.suffix == ".gguf"):
        # The default keeps the blocks where they have been measured to pay:
        # the CPU's native kernels. On a GPU, quantization="gguf" asks for them.
        kernels = _block_kernels(config)
        keep_blocks = (
            fmt == "gguf"
            and config.tensor_parallel_size == 1
            and (
                (config.quantization is None and kernels == "native")
                or (config.quantization == "gguf" and kernels is not None)
            )
        )
        gguf = load_gguf(path, dtype=torch_dtype(config), keep_blocks=keep_blocks)
        hf_config, tokenizer = gguf.config, gguf.tokenizer
        _apply_overrides(hf_config, config.hf_overrides)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        plan = block_plan(
            gguf.state_dict,
            tied,
            resolve_model_class(hf_config).module_of,
            _runnable_formats(kernels, config.quantization),
        )
        state = gguf.state_dict
    else:
        hf_config = _read_config(path)
        hf_config = resolve_model_class(hf_config).language_config(hf_config)
        _apply_overrides(hf_config, config.hf_overrides)
        if (
            fmt == "safetensors"
            and config.quantization is None
            and _block_kernels(config) == "native"
        ):
            plan = resolve_model_class(hf_config).checkpoint_block_plan(hf_config)
    if config.tokenizer is not None or tokenizer is None:
        source = resolve_model_path(config.tokenizer) if config.tokenizer else path
        tokenizer = _load_tokenizer(source, fmt)
    model, plan = build_model(hf_config, config, plan)
    weights: Iterator[tuple[str, torch.Tensor]] | None = None
    if fmt == "gguf":
        # (under tensor parallelism the file is read whole, then sliced)
        blocks_or_dense = _with_plan(state, plan, torch_dtype(config), model.module_of)
        weights = _sharded(model, blocks_or_dense)
    elif fmt == "safetensors":
        weights = _safetensors_weights(path, model.shard_of)
    if weights is None:
        init_dummy_weights(model, config.seed)
    else:
        with torch.device(torch_device(config)):
            model.load_weights(
                (
                    name,
                    t
                    if t.dtype == torch.uint8  # block-format bytes, as stored
                    else t.to(device=torch_device(config), dtype=torch_dtype(config)),
                )
                for name, t in weights
            )
    model.eval()
    tokens = model.score_from_tokens
    if tokens:
        model.derive_score_head(_token_ids(tokenizer, tokens))
    if quantize_to is not None:
        quantize_linear_layers(model, quantize_to)
    if _block_kernels(config) == "triton":
        split_block_layers(model, torch_dtype(config))
    if _block_kernels(config) == "native":
        pack_block_layers(model)  # blocks in the CPU kernels' panels (quant_linear.py)
    if torch_device(config).type == "cpu" and torch_dtype(config) == torch.float32:
        pack_linear_layers(model)  # weights in oneDNN's layout (see cpu_linear.py)
    model.prepare_fused_decode()
    if config.batch_invariant:
        fused = getattr(model, "fused_decode", None)
        if fused is None:
            raise InvalidArgumentError(
                f"batch_invariant runs on the CPU in float32 with block-format weights, on "
                f"the families whose layers run natively; {type(model).__name__} here "
                f"({torch_device(config).type}, {torch_dtype(config)}) does not"
            )
        fused.make_batch_invariant(model)
    return LoadedModel(
        hf_config=hf_config,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(path, hf_config, tokenizer),
        source=str(path),
        load_seconds=time.perf_counter() - start,
    )


def _block_kernels(config: EngineConfig) -> str | None:
    """What runs block-format weights: "native" (the CPU kernels, float32),
    "triton" (a GPU, any float dtype), or None."""
    if torch_device(config).type == "cuda":
        return "triton"
    if torch_device(config).type == "cpu" and torch_dtype(config) == torch.float32:
        return "native"
    return None


def _runnable_formats(kernels: str | None, quantization: str | None) -> tuple[str, ...]:
    """The block formats a GGUF file's modules may keep: those the kernels
    run, and on the CPU with quantization="gguf" (the file's blocks as
    stored) also the K-quants its kernels run in less memory but no faster
    in batches (Q6_K, Q4_K)."""
    if kernels == "native" and quantization == "gguf":
        return KERNEL_FORMATS + STORED_FORMATS
    return KERNEL_FORMATS


def _check_quantization(config: EngineConfig, fmt: str) -> str | None:
    """The block format to quantize float weights into at load, if any."""
    q = config.quantization
    if q == "gguf" and fmt != "gguf":
        raise InvalidArgumentError("quantization='gguf' needs a GGUF model file loaded from it")
    if q in ("gguf", "q8_0", "q4_1") and _block_kernels(config) is None:
        raise InvalidArgumentError(
            f"quantization={q!r} runs on a GPU or on the CPU in float32; "
            f"got device {torch_device(config).type}, dtype {torch_dtype(config)}"
        )
    return q if q in ("q8_0", "q4_1") else None


def block_plan(
    state: dict[str, torch.Tensor | BlockTensor],
    tied: bool,
    module_of: Callable[[str], str],
    runnable: tuple[str, ...] = KERNEL_FORMATS,
) -> dict[str, str]:
    """Model modules (our names) that keep block-format weights, and their
    format: those whose every tensor part is in a block format. Q4_K where
    it is not `runnable` (by default, on a GPU) comes to Q4_1 (its 4-bit
    values kept, `q4_k_as_q4_1`). The merged q/k/v and gate/up
    projections hold one format: parts in different ones (a Q4_K_M file's
    Q4_K queries and keys beside Q6_K values), or in one not `runnable`
    (Q6_K, unless the file's blocks are kept as stored), all come to Q8_0
    (`_with_plan`); a tied LM head follows the embedding."""
    parts: dict[str, set[str | None]] = {}
    for name, t in state.items():
        if not name.endswith(".weight"):
            continue
        fmt = t.fmt if isinstance(t, BlockTensor) else None
        if fmt == "q4_k" and fmt not in runnable:
            fmt = "q4_1"
        parts.setdefault(module_of(name), set()).add(fmt)
    plan: dict[str, str] = {}
    for module, formats in parts.items():
        blocks = {fmt for fmt in formats if fmt is not None}
        if len(blocks) == len(formats):
            if blocks == {"q4_k", "q4_1"}:  # (Q4_0 or Q4_1 parts beside Q4_K)
                blocks = {"q4_1"}
            (plan[module],) = blocks if len(blocks) == 1 and blocks <= set(runnable) else {"q8_0"}
    if tied and "embed_tokens" in plan:
        plan["lm_head"] = plan["embed_tokens"]
    return plan


def _with_plan(
    state: dict[str, torch.Tensor | BlockTensor],
    plan: dict[str, str],
    dtype: torch.dtype,
    module_of: Callable[[str], str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Block tensors of planned modules as their bytes (in the module's
    format); the others dense."""
    for name, t in state.items():
        if isinstance(t, BlockTensor):
            fmt = plan.get(module_of(name))
            if fmt == t.fmt:
                yield name, t.data
            elif fmt == "q4_1" and t.fmt == "q4_k":
                q4_1 = q4_k_as_q4_1(t.data.numpy().reshape(-1))
                yield name, torch.from_numpy(q4_1.reshape(*t.data.shape[:-1], -1))
            elif fmt is not None:
                rows = t.data.reshape(-1, t.data.shape[-1])
                dense = dequantize(rows, t.fmt, t.in_features)
                yield name, requantized(dense, fmt).data.reshape(*t.data.shape[:-1], -1)
            else:
                yield name, dequantize(t.data, t.fmt, t.in_features).to(dtype)
        else:
            yield name, t


def quantize_linear_layers(model: torch.nn.Module, fmt: str) -> int:
    """Replaces every float `nn.Linear` with a QuantLinear in `fmt`, but in
    the modules a family keeps apart (`own_modules`: a vision tower, which
    stays in float as llama.cpp keeps its projector file)."""
    apart = tuple(getattr(model, "own_modules", ()))
    kept = {id(m) for name, m in model.named_modules() if apart and name.startswith(apart)}
    targets = [t for t in linear_layers(model) if id(t[0]) not in kept]
    for parent, name, child in targets:
        setattr(parent, name, QuantLinear.from_linear(child, fmt))
    return len(targets)


def split_block_layers(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """On a GPU: splits every block-format layer's weight for the Triton
    kernel (see layers/quant_linear.py)."""
    shared: dict[int, Any] = {}
    layers = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    for module in layers:
        if isinstance(module, QuantEmbedding):
            module.split_for_triton(shared, dtype)
        else:
            module.split_for_triton(shared)
    return len(layers)


def pack_block_layers(model: torch.nn.Module) -> int:
    """On the CPU: every block-format layer's weight in the panels this
    CPU's kernel reads, if it reads panels (see layers/quant_linear.py)."""
    if not quant_linear.PACK_FOR_CPU:
        return 0
    shared: dict[int, torch.nn.Parameter] = {}
    layers = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    for module in layers:
        if module.weight.device.type == "cpu" and not module.packed:
            module.pack_for_cpu(shared)
    return len(layers)


def _use_blocks(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Swaps the planned modules (still on the meta device) for block-format
    ones; returns the plan carried out. A module that is not a plain linear
    layer or embedding (an MoE router, kept in float) stays as it is, and
    its weight is dequantized."""
    done: dict[str, str] = {}
    for path, fmt in plan.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, attr)
        if type(old) is torch.nn.Linear:
            new: torch.nn.Module = QuantLinear(
                old.in_features, old.out_features, old.bias is not None, fmt
            )
        elif type(old) is torch.nn.Embedding:
            new = QuantEmbedding(old.num_embeddings, old.embedding_dim, fmt)
        else:
            continue
        setattr(parent, attr, new)
        done[path] = fmt
    return done


def build_model(
    hf_config: PretrainedConfig, config: EngineConfig, plan: dict[str, str] | None = None
) -> tuple[CausalLM, dict[str, str]]:
    """The model on the device with uninitialised weights, and the part of
    `plan` (modules -> block format) it carries out."""
    cls = resolve_model_class(hf_config)
    backend = get_attention_backend(config.attention_backend, torch_device(config))
    # Parameters are created on the meta device, then materialised once on
    # the target device in the target dtype (no throwaway CPU init).
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(config))
    try:
        with torch.device("meta"):
            model = cls(hf_config, backend)
            done = _use_blocks(model, plan or {})
    finally:
        torch.set_default_dtype(previous_dtype)
    model = model.to_empty(device=torch_device(config))
    model.reset_buffers(torch_device(config), resolve_max_model_len(config, hf_config))
    return model, done


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights for benchmarks: N(0, 0.02) matrices, unit norms, zero biases."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)


def _apply_overrides(hf_config: PretrainedConfig, overrides: dict[str, Any] | str | None) -> None:
    for key, value in (parse_overrides(overrides) or {}).items():
        try:
            setattr(hf_config, key, value)
        except Exception as e:  # the config class checks its fields (its own error types)
            raise ModelLoadError(f"hf_overrides cannot set {key!r} to {value!r}: {e}") from e


def _token_ids(tokenizer: Any | None, tokens: list[str]) -> list[int]:
    """The vocabulary ids of `tokens` (classifier_from_token), each one token."""
    if tokenizer is None:
        raise ModelLoadError("classifier_from_token needs the model's tokenizer")
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ModelLoadError(
                f"classifier_from_token: {token!r} is not a token of the vocabulary"
            )
        ids.append(token_id)
    return ids


def _read_config(path: Path) -> PretrainedConfig:
    directory = path if path.is_dir() else path.parent
    if not (directory / "config.json").exists():
        raise ModelLoadError(f"{str(directory)!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read the model config in {str(directory)!r}: {e}") from e


def _sharded(
    model: CausalLM, weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors narrowed to this rank's slices (tensor parallelism)."""
    for name, tensor in weights:
        spec = model.shard_of(name, tuple(tensor.shape))
        yield name, tensor if spec is None else tensor.narrow(*spec)


def _safetensors_weights(
    path: Path, shard_of: Callable[[str, tuple[int, ...]], tuple[int, int, int] | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, or only this rank's slice of it (read from the file as
    a slice: a rank never loads the whole tensor)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {str(path)!r}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                lazy = f.get_slice(name)
                spec = shard_of(name, tuple(lazy.get_shape()))
                if spec is None:
                    yield name, f.get_tensor(name)
                else:
                    dim, start, length = spec
                    yield name, lazy[(slice(None),) * dim + (slice(start, start + length),)]


def _load_tokenizer(path: Path, fmt: str) -> Any | None:
    directory = path if path.is_dir() else path.parent
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if fmt == "dummy":
            return None  # random weights may come without a tokenizer: token ids only
        raise ModelLoadError(f"cannot load a tokenizer from {str(directory)!r}: {e}") from e


def _eos_token_ids(path: Path, hf_config: Any, tokenizer: Any | None) -> list[int]:
    ids: list[int] = []
    gen_config = (path if path.is_dir() else path.parent) / "generation_config.json"
    sources: list[Any] = []
    if gen_config.exists() and path.is_dir():
        sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
    sources.append(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for src in sources:
        for value in src if isinstance(src, list) else [src]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return ids
