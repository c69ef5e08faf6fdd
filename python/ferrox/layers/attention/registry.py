"""Attention backends by name; `auto` picks the best one for the device."""

import torch

from ferrox.common.errors import InvalidArgumentError
from ferrox.layers.attention.base import AttentionBackend
from ferrox.layers.attention.cpu_backend import CpuAttentionBackend
from ferrox.layers.attention.flash_attn_backend import FlashAttnBackend
from ferrox.layers.attention.torch_backend import TorchAttentionBackend
from ferrox.layers.attention.triton_backend import TritonAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls
    for cls in (
        CpuAttentionBackend,
        TritonAttentionBackend,
        FlashAttnBackend,
        TorchAttentionBackend,
    )
}
# Preference order for `auto`: the first that supports the device wins. `cpu`
# supports only CPUs and comes first, so a CPU device never gets `triton` even
# under TRITON_INTERPRET=1; on CUDA `triton` wins. flash-attn's paged kernels
# need blocks of a multiple of 256 tokens, so it is picked by name only.
_AUTO_ORDER: list[str] = [
    CpuAttentionBackend.name,
    TritonAttentionBackend.name,
    TorchAttentionBackend.name,
]


def register_backend(cls: type[AttentionBackend], *, preferred: bool = False) -> None:
    _BACKENDS[cls.name] = cls
    if preferred:
        _AUTO_ORDER.insert(0, cls.name)
    else:
        _AUTO_ORDER.append(cls.name)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    if name == "auto":
        for candidate in _AUTO_ORDER:
            cls = _BACKENDS[candidate]
            if cls.is_supported(device):
                return cls
        return TorchAttentionBackend
    named = _BACKENDS.get(name)
    if named is None:
        raise InvalidArgumentError(
            f"attention_backend must be 'auto' or one of {available_backends()}, got {name!r}"
        )
    if not named.is_supported(device):
        raise InvalidArgumentError(f"attention backend {name!r} does not run on {device}")
    return named
