"""Resolves `EngineConfig.model` / `load_format` to a config, weights on the
device and a tokenizer: a Hugging Face directory (safetensors), a GGUF file,
random weights (`dummy`), or the bundled default model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from ferrox.config import EngineConfig
from ferrox.errors import ModelLoadError
from ferrox.layers.attention import get_attention_backend
from ferrox.layers.cpu_linear import pack_linear_layers
from ferrox.layers.rotary import RotaryEmbedding, rope_parameters
from ferrox.loader.gguf import load_gguf, load_gguf_tokenizer
from ferrox.loader.hub import resolve_model_path
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.registry import resolve_model_class


@dataclass
class LoadedModel:
    hf_config: PretrainedConfig
    model: LlamaForCausalLM
    tokenizer: Any | None  # a PreTrainedTokenizerFast, or None (token ids only)
    eos_token_ids: list[int]
    source: str
    load_seconds: float


def load_model(config: EngineConfig) -> LoadedModel:
    start = time.perf_counter()
    path = resolve_model_path(config.model)
    fmt = config.load_format
    if fmt == "auto":
        fmt = "gguf" if path.suffix == ".gguf" else "safetensors"
    tokenizer = None
    if fmt == "gguf" or (fmt == "dummy" and path.suffix == ".gguf"):
        gguf = load_gguf(path, dtype=config.torch_dtype)
        hf_config, tokenizer = gguf.config, gguf.tokenizer
        weights: Iterator[tuple[str, torch.Tensor]] | None = iter(gguf.state_dict.items())
    else:
        hf_config = _read_config(path)
        weights = _safetensors_weights(path) if fmt == "safetensors" else None
    if config.tokenizer is not None or tokenizer is None:
        source = resolve_model_path(config.tokenizer) if config.tokenizer else path
        tokenizer = _load_tokenizer(source, fmt)
    model = build_model(hf_config, config)
    if weights is None:
        init_dummy_weights(model, config.seed)
    else:
        with torch.device(config.torch_device):
            model.load_weights(
                (name, t.to(device=config.torch_device, dtype=config.torch_dtype))
                for name, t in weights
            )
    model.eval()
    if config.torch_device.type == "cpu" and config.torch_dtype == torch.float32:
        pack_linear_layers(model)  # weights in oneDNN's layout (see cpu_linear.py)
    return LoadedModel(
        hf_config=hf_config,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(path, hf_config, tokenizer),
        source=str(path),
        load_seconds=time.perf_counter() - start,
    )


def load_tokenizer(config: EngineConfig) -> Any | None:
    """The tokenizer alone (for a frontend process that runs no model)."""
    if config.tokenizer is not None:
        return _load_tokenizer(resolve_model_path(config.tokenizer), config.load_format)
    path = resolve_model_path(config.model)
    if path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    return _load_tokenizer(path, config.load_format)


def build_model(hf_config: PretrainedConfig, config: EngineConfig) -> LlamaForCausalLM:
    cls = resolve_model_class(hf_config)
    backend = get_attention_backend(config.attention_backend, config.torch_device)
    # Parameters are created on the meta device, then materialised once on
    # the target device in the target dtype (no throwaway CPU init).
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.torch_dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config, backend)
    finally:
        torch.set_default_dtype(previous_dtype)
    model = model.to_empty(device=config.torch_device)
    _reset_buffers(model, hf_config, config)
    return model


def _reset_buffers(model: LlamaForCausalLM, hf_config: Any, config: EngineConfig) -> None:
    # Buffers (rotary tables) were created on the meta device: rebuild them.
    with torch.device(config.torch_device):
        rotary = RotaryEmbedding(
            model.head_dim, hf_config.max_position_embeddings, rope_parameters(hf_config)
        )
    model.rotary = rotary
    for layer in model.decoder_layers():
        layer.self_attn.rotary = rotary
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


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


def _read_config(path: Path) -> PretrainedConfig:
    directory = path if path.is_dir() else path.parent
    if not (directory / "config.json").exists():
        raise ModelLoadError(f"{str(directory)!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read the model config in {str(directory)!r}: {e}") from e


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
                yield name, f.get_tensor(name)


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
