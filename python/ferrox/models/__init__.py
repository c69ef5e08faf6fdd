"""Decoder-only model implementations over the paged KV cache."""

from ferrox.models.registry import resolve_model_class, supported_architectures

__all__ = ["resolve_model_class", "supported_architectures"]
