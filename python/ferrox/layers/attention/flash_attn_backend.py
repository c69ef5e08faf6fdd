"""Attention with flash-attn 2 (`flash_attn_varlen_func`), CUDA only, when
`import flash_attn` works. Its paged path reads the cache through the block
table and needs blocks of a multiple of 256 tokens (`block_size=256`); steps
of fresh prompts only attend over the chunks' own K/V and take any block size.
Chosen by name, never by `auto`."""

import torch
import torch.nn.functional as F

from ferrox.common.errors import InvalidArgumentError
from ferrox.layers.attention.base import AttentionBackend, AttentionMetadata

_PAGE_MULTIPLE = 256


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        from flash_attn import flash_attn_varlen_func

        from ferrox.triton_kernels.kv_store import store_kv

        self._varlen = flash_attn_varlen_func
        self._store_kv = store_kv

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        try:
            import flash_attn  # noqa: F401
        except (ImportError, OSError):
            return False
        return True

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
        qsl = meta.query_start_loc  # [B + 1] int32
        if meta.num_decodes == 0 and not meta.num_computed_cpu.any():
            # Fresh prompts only: causal attention over the chunks themselves.
            return self._varlen(
                q,  # [T, H, D]
                k,  # [T, Hkv, D]
                v,
                qsl,
                qsl,
                meta.max_query_len,
                meta.max_query_len,
                softmax_scale=self.scale,
                causal=True,
            )
        block_size = k_cache.shape[1]
        if block_size % _PAGE_MULTIPLE:
            raise InvalidArgumentError(
                f"the flash-attn backend reads the paged cache only with block_size a multiple "
                f"of {_PAGE_MULTIPLE}, got {block_size}; use block_size={_PAGE_MULTIPLE} or the "
                "triton backend"
            )
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
        # causal=True aligns each chunk to the end of its context: the query at
        # chunk position i sees cached tokens plus chunk tokens up to i.
        return self._varlen(
            q,  # [T, H, D]
            k_cache,  # [N, BS, Hkv, D]
            v_cache,
            qsl,
            cu_seqlens_k,
            meta.max_query_len,
            meta.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_table,  # [B, W] int32
        )
