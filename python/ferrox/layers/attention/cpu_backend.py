"""CPU attention: a Rust kernel reads the paged cache in place for rows of
a few query tokens (decodes, speculative verifications) and for rows behind
a context computed before (a prompt's tail after a prefix-cache hit, a later
prefill chunk); longer fresh prompts, and rows whose image tokens attend
both ways, use torch's matrix-multiply attention (fused causal attention for
fresh prompts, a gathered context and a mask with images).
Float32 queries only (other dtypes fall back to the torch backend), over a
float32 or float16 cache."""

import sys

import numpy as np
import torch

from ferrox._native import paged_attention_cpu
from ferrox.layers.attention.base import AttentionMetadata
from ferrox.layers.attention.torch_backend import TorchAttentionBackend, store_kv
from ferrox.layers.native import kernel_threads, kv_array

# Rows of at most this many query tokens are decode-like (decodes, a
# speculative verification's few positions): the fused CPU layers take any
# step of them (layers/cpu_decoder.py).
SHORT_QUERY_LEN = 17
# Which rows the paged kernel attends: fresh prompts of at most
# PAGED_FRESH_QUERY_LEN query tokens, and rows after a context computed
# before (a prompt's tail behind a prefix-cache hit, a later prefill chunk)
# of at most SHORT_QUERY_LEN_AFTER_CONTEXT; longer ones (none: both have no
# limit) and rows with image tokens take matrix-multiply attention. Behind
# a context, matrix-multiply attention would first gather the whole context,
# block by block, and the kernel's tile loops (a tile's queries take each block together)
# measured faster at every length and context (`benches/cpu_attention_rows.py`);
# for fresh prompts the kernel, reading their keys back from the cache,
# measured faster end to end too (`benches/quant_batches.py`, performance.md).
PAGED_FRESH_QUERY_LEN = sys.maxsize
SHORT_QUERY_LEN_AFTER_CONTEXT = sys.maxsize


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    supports_sliding_window = True
    supports_sinks = True
    supports_image_spans = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.num_threads = kernel_threads()

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        return device.type == "cpu"

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
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super().forward(q, k, v, k_cache, v_cache, meta, sinks)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)  # [T, H, D]
        single_rows, chunk_rows = meta.row_split(
            PAGED_FRESH_QUERY_LEN, SHORT_QUERY_LEN_AFTER_CONTEXT
        )
        if meta.image_spans:  # the paged kernel is causal: image rows take the mask path
            masked = np.isin(single_rows, list(meta.image_spans))
            chunk_rows = np.concatenate((single_rows[masked], chunk_rows))
            single_rows = single_rows[~masked]
        if len(single_rows):
            paged_attention_cpu(
                out.numpy(),
                q.numpy(),
                kv_array(k_cache),
                kv_array(v_cache),
                meta.block_table_cpu
                if meta.block_table_cpu is not None
                else meta.block_table.numpy(),  # on the CPU the two are one
                meta.query_start_loc_cpu,
                meta.seq_lens_cpu,
                single_rows,
                self.scale,
                self.num_threads,
                meta.sliding_window,
                None if sinks is None else sinks.detach().float().contiguous().numpy(),
            )
        for row in chunk_rows.tolist():
            self._attend_chunk(q, k, v, k_cache, v_cache, meta, row, out, sinks)
        return out
