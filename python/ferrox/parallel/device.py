"""The torch device and dtype an engine configuration names.

`EngineConfig` (in `ferrox.common`, which imports no torch) holds them as
strings; the layers that run the model resolve them here, once per name.
"""

from __future__ import annotations

import functools

import torch

from ferrox.common.config import DTYPE_NAMES, EngineConfig
from ferrox.common.errors import InvalidArgumentError


def torch_device(config: EngineConfig) -> torch.device:
    """The device `config.device` names ("auto": CUDA when available)."""
    return _device(config.device)


def torch_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype `config.dtype` names ("auto": bfloat16 on CUDA, float32 on CPU)."""
    if config.dtype == "auto":
        return torch.bfloat16 if torch_device(config).type == "cuda" else torch.float32
    return getattr(torch, DTYPE_NAMES[config.dtype])  # type: ignore[no-any-return]


@functools.cache
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {name!r} was asked for, but CUDA is not available")
    return device
