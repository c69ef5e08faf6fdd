"""Attention with ferrox's Triton kernels: a KV-store launch, then one decode
launch (plus a split reduction for small batches of long contexts) and one
prefill launch per layer. Runs on CUDA, and on the CPU under the Triton
interpreter (`TRITON_INTERPRET=1`, for tests)."""

import importlib.util
import os

import torch

from ferrox.layers.attention.base import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # Imported here, not with this module: whether the kernels are compiled
        # or interpreted is fixed when they are first imported (TRITON_INTERPRET).
        from ferrox.triton_kernels.kv_store import store_kv
        from ferrox.triton_kernels.paged_attention import paged_attention

        self._store_kv = store_kv
        self._paged_attention = paged_attention

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        if importlib.util.find_spec("triton") is None:
            return False
        if device.type == "cuda":
            return True
        return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert sinks is None, "this backend has no attention sinks (supports_sinks)"
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._paged_attention(
            q,  # [T, H, D]
            k_cache,
            v_cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            num_decodes=meta.num_decodes,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            scale=self.scale,
        )
