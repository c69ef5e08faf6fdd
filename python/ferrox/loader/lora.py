"""Reading a LoRA adapter's tensors (checked first by `common.lora.read_adapter`)."""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ferrox.common.errors import LoRAAdapterError
from ferrox.common.lora import ADAPTER_WEIGHTS, AdapterSpec


def load_adapter_tensors(spec: AdapterSpec) -> dict[tuple[int, str, str], torch.Tensor]:
    """(layer, module, "A" or "B") -> the tensor, on the CPU, as float32."""
    path = spec.path / ADAPTER_WEIGHTS
    try:
        raw = load_file(str(path), device="cpu")
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(f"cannot read {path}: {e}") from e
    if set(raw) != set(spec.tensors):
        raise LoRAAdapterError(f"{path} changed while it was read")
    return {spec.tensors[name]: t.to(torch.float32) for name, t in raw.items()}
