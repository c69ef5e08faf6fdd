"""Attention over the paged KV cache, behind a backend interface."""

from ferrox.layers.attention.base import AttentionBackend, AttentionMetadata
from ferrox.layers.attention.registry import available_backends, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_attention_backend"]
