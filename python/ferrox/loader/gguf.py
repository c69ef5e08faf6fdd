"""Loading a GGUF file (llama.cpp's format) as a Hugging Face config, state dict and tokenizer.

Tensors are dequantized to dense weights with Hugging Face parameter names, so the same model code
serves GGUF files and safetensors checkpoints. For Llama, llama.cpp's converter reorders the rows
of the Q and K projections of each head from the half-split rotary layout (HF) to the interleaved
one; `_unpermute_rotary_rows` puts them back.
"""

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.loader.gguf_dequant import BlockTensor, block_tensor, dequantize_tensor
from ferrox.loader.gguf_reader import open_gguf
from ferrox.loader.gguf_tokenizer import build_tokenizer


@dataclass(frozen=True)
class GGUFModel:
    """Everything needed to run a GGUF model with Hugging Face-style model code."""

    config: PretrainedConfig
    state_dict: dict[str, torch.Tensor | BlockTensor]
    tokenizer: PreTrainedTokenizerFast


@dataclass(frozen=True)
class _Architecture:
    config_class: Any  # a PretrainedConfig subclass, given the architecture's fields
    hf_class_name: str
    is_rotary_interleaved: bool  # llama.cpp permuted the Q/K rows of each head
    has_qk_norm: bool


_ARCHITECTURES = {
    "llama": _Architecture(LlamaConfig, "LlamaForCausalLM", True, False),
    "qwen2": _Architecture(Qwen2Config, "Qwen2ForCausalLM", False, False),
    "qwen3": _Architecture(Qwen3Config, "Qwen3ForCausalLM", False, True),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, keep_blocks: bool = False
) -> GGUFModel:
    """Read a GGUF file and dequantize its tensors into `dtype`; with
    `keep_blocks`, 2-D Q4_0 / Q4_1 / Q8_0 tensors stay in their blocks
    (BlockTensor)."""
    if not dtype.is_floating_point:
        raise InvalidArgumentError(f"dtype must be a floating point type, got {dtype}")
    reader, metadata = open_gguf(path, mode="c")  # copy-on-write: writable views
    arch_name = metadata.get("general.architecture")
    arch = _ARCHITECTURES.get(arch_name) if isinstance(arch_name, str) else None
    if arch is None or not isinstance(arch_name, str):
        raise UnsupportedModelError(
            f"GGUF architecture {arch_name!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = _build_config(metadata, tensor_names, arch_name, arch)

    state_dict: dict[str, torch.Tensor | BlockTensor] = {}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name, arch)
        blocks = block_tensor(tensor) if keep_blocks else None
        # [out_features, in_features] (uint8 row bytes for blocks) or [features]
        weight = dequantize_tensor(tensor) if blocks is None else blocks.data
        if arch.is_rotary_interleaved and ".q_proj." in name:
            weight = _unpermute_rotary_rows(weight, config.num_attention_heads)
        elif arch.is_rotary_interleaved and ".k_proj." in name:
            weight = _unpermute_rotary_rows(weight, config.num_key_value_heads)
        if blocks is None:
            state_dict[name] = weight.to(dtype)
        else:
            state_dict[name] = BlockTensor(blocks.fmt, weight.contiguous(), blocks.in_features)
    if "model.embed_tokens.weight" not in state_dict:
        raise ModelLoadError(f"{path} has no token embedding tensor (token_embd.weight)")

    return GGUFModel(config=config, state_dict=state_dict, tokenizer=build_tokenizer(metadata))


def _build_config(
    metadata: dict[str, Any], tensor_names: set[str], arch_name: str, arch: _Architecture
) -> PretrainedConfig:
    def value(key: str, default: Any = None) -> Any:
        found = metadata.get(f"{arch_name}.{key}", default)
        if found is None:
            raise ModelLoadError(f"GGUF metadata lacks '{arch_name}.{key}'")
        return found

    hidden_size = value("embedding_length")
    num_heads = value("attention.head_count")
    num_kv_heads = value("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise UnsupportedModelError("GGUF files with a per-layer KV head count are not supported")
    head_dim = value("attention.key_length", hidden_size // num_heads)
    if value("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if value("rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError("GGUF files with RoPE scaling are not supported yet")

    has_bias = "blk.0.attn_q.bias" in tensor_names
    extra = {"attention_bias": has_bias} if arch_name != "qwen2" else {}
    if arch_name == "llama":
        extra["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    return arch.config_class(
        architectures=[arch.hf_class_name],
        vocab_size=value("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
        hidden_size=hidden_size,
        intermediate_size=value("feed_forward_length"),
        num_hidden_layers=value("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=value("context_length"),
        rope_theta=float(value("rope.freq_base", 10000.0)),
        rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        **extra,
    )


def _hf_tensor_name(gguf_name: str, arch: _Architecture) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        block, _, rest = stem.partition(".")
        layer, _, part = rest.partition(".")
        layer_tensors = _LAYER_TENSORS | (_QK_NORM_TENSORS if arch.has_qk_norm else {})
        if block == "blk" and layer.isdigit() and part in layer_tensors:
            return f"model.layers.{layer}.{layer_tensors[part]}.{suffix}"
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no counterpart in {arch.hf_class_name}"
    )


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order: rows (j, 0), (j, 1) for j < half -> (0, j), (1, j)."""
    rows = weight.shape[0]  # num_heads * head_dim
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # [heads, half, 2, ...]
    return per_head.transpose(1, 2).reshape(weight.shape)  # [heads * 2 * half, ...]
