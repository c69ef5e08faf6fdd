"""Loading a GGUF file (llama.cpp's format) as a Hugging Face config, state dict and tokenizer.

Tensors are dequantized to dense weights (or kept as block rows) with Hugging Face parameter
names, so the same model code serves GGUF files and safetensors checkpoints. What a family's
names and metadata mean is the family's own (`config_from_gguf`, `checkpoint_name`,
`from_gguf_tensor` in models/); this module only reads the file.
"""

import os
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from ferrox.common.errors import InvalidArgumentError, ModelLoadError
from ferrox.loader.gguf_dequant import BlockTensor, block_tensor, dequantize_tensor
from ferrox.model_files.gguf_reader import open_gguf
from ferrox.model_files.gguf_tokenizer import build_tokenizer
from ferrox.models.registry import resolve_gguf_model_class


@dataclass(frozen=True)
class GGUFModel:
    """Everything needed to run a GGUF model with Hugging Face-style model code."""

    config: PretrainedConfig
    state_dict: dict[str, torch.Tensor | BlockTensor]
    tokenizer: PreTrainedTokenizerFast


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, keep_blocks: bool = False
) -> GGUFModel:
    """Read a GGUF file and dequantize its tensors into `dtype`; with
    `keep_blocks`, Q4_0 / Q4_1 / Q8_0 matrices (and stacks of them) stay in
    their blocks (BlockTensor)."""
    if not dtype.is_floating_point:
        raise InvalidArgumentError(f"dtype must be a floating point type, got {dtype}")
    reader, metadata = open_gguf(path, mode="c")  # copy-on-write: writable views
    family = resolve_gguf_model_class(metadata.get("general.architecture"))
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = family.config_from_gguf(metadata, tensor_names)

    state_dict: dict[str, torch.Tensor | BlockTensor] = {}
    for tensor in reader.tensors:
        blocks = block_tensor(tensor) if keep_blocks else None
        # [out_features, in_features] (uint8 row bytes for blocks), [features],
        # or stacked experts' [experts, out_features, ...]
        stored = dequantize_tensor(tensor) if blocks is None else blocks.data
        for name, part in family.checkpoint_tensors(tensor.name, stored):
            weight = family.from_gguf_tensor(name, part, config)
            if blocks is None:
                state_dict[name] = weight.to(dtype)
            else:
                state_dict[name] = BlockTensor(blocks.fmt, weight.contiguous(), blocks.in_features)
    if "model.embed_tokens.weight" not in state_dict:
        raise ModelLoadError(f"{path} has no token embedding tensor (token_embd.weight)")

    return GGUFModel(config=config, state_dict=state_dict, tokenizer=build_tokenizer(metadata))
