"""Attention with plain PyTorch ops (scaled_dot_product_attention), for the
CPU and as a reference on any device."""

import torch
import torch.nn.functional as F

from ferrox.layers.attention.base import AttentionBackend, AttentionMetadata


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    # k, v: [T, Hkv, D]; caches: [N, BS, Hkv, D] (maybe of another dtype,
    # see kv_cache_dtype); slots: [T]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [N, BS, Hkv, D]; block_table: [..., W] -> [..., W * BS, Hkv, D][..., :length]
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[..., :num_blocks].long()]  # [..., nb, BS, Hkv, D]
    shape = (*blocks.shape[:-4], num_blocks * block_size, *blocks.shape[-2:])
    return blocks.reshape(shape)[..., :length, :, :]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_sliding_window = True
    supports_sinks = True
    supports_image_spans = True

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
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # [T, H, D]
        # (a window's decodes, and decodes with sinks, go row by row: a
        # padded gather would read blocks behind their windows)
        d = 0 if meta.sliding_window or sinks is not None else meta.num_decodes
        if meta.image_spans:  # (rows with images attend through a mask)
            d = min(d, min(meta.image_spans))
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta)
        for row in range(d, meta.num_reqs):
            self._attend_chunk(q, k, v, k_cache, v_cache, meta, row, out, sinks)
        return out

    def _attend_chunk(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        row: int,
        out: torch.Tensor,  # [T, H, D], written for this row's tokens
        sinks: torch.Tensor | None = None,
    ) -> None:
        start, end = int(meta.query_start_loc_cpu[row]), int(meta.query_start_loc_cpu[row + 1])
        num_cached = int(meta.num_computed_cpu[row])
        window = meta.sliding_window
        spans = meta.image_spans.get(row) if meta.image_spans else None
        fresh = num_cached == 0 and (not window or end - start <= window)
        if fresh and sinks is None and not spans:
            # Nothing cached (and no query's window cut): attend over the chunk's own K/V.
            out[start:end] = self._attend(q[start:end], k[start:end], v[start:end], None, True)
            return
        seq_len = int(meta.seq_lens_cpu[row])
        # The first block any query reads: the window of the chunk's first query.
        first = max(num_cached + 1 - window, 0) // k_cache.shape[1] if window else 0
        offset = first * k_cache.shape[1]
        table = meta.block_table[row, first:]
        ctx_k = gather_context(k_cache, table, seq_len - offset).to(q.dtype)  # [L, Hkv, D]
        ctx_v = gather_context(v_cache, table, seq_len - offset).to(q.dtype)
        q_pos = torch.arange(num_cached, seq_len, device=q.device)  # [n]
        k_pos = torch.arange(offset, seq_len, device=q.device)  # [L]
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, L]
        for lo, hi in spans or ():
            # An image's tokens see each other (a window still bounds them).
            inside_q = (q_pos >= lo) & (q_pos < hi)
            inside_k = (k_pos >= lo) & (k_pos < hi)
            mask |= inside_q[:, None] & inside_k[None, :]
        if window:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        if sinks is not None:
            out[start:end] = self._attend_with_sinks(q[start:end], ctx_k, ctx_v, mask, sinks)
            return
        out[start:end] = self._attend(q[start:end], ctx_k, ctx_v, mask, False)

    def _attend(
        self,
        q: torch.Tensor,  # [n, H, D]
        k: torch.Tensor,  # [L, Hkv, D]
        v: torch.Tensor,  # [L, Hkv, D]
        mask: torch.Tensor | None,  # [n, L] bool
        is_causal: bool,
    ) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, n, D]
            k.transpose(0, 1),  # [Hkv, L, D]
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.transpose(0, 1)  # [n, H, D]

    def _attend_with_sinks(
        self,
        q: torch.Tensor,  # [n, H, D]
        k: torch.Tensor,  # [L, Hkv, D]
        v: torch.Tensor,  # [L, Hkv, D]
        mask: torch.Tensor,  # [n, L] bool
        sinks: torch.Tensor,  # [H]
    ) -> torch.Tensor:
        """Softmax attention whose denominators also hold exp(sink) per
        head: the scores with a sink column appended, the column dropped
        after the softmax (in float32)."""
        group = self.num_heads // self.num_kv_heads
        keys = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, L, D]
        values = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        scores = torch.matmul(q.transpose(0, 1).float(), keys.transpose(1, 2)) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))  # [H, n, L]
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs, values).transpose(0, 1).to(q.dtype)  # [n, H, D]

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # q: [B, H, D], one token per row, over contexts of seq_lens[:B].
        num = q.shape[0]
        seq_lens = meta.seq_lens[:num]
        max_len = int(meta.seq_lens_cpu[:num].max())
        ctx_k = gather_context(k_cache, meta.block_table[:num], max_len).to(q.dtype)
        ctx_v = gather_context(v_cache, meta.block_table[:num], max_len).to(q.dtype)
        positions = torch.arange(max_len, device=q.device)
        mask = (positions[None, :] < seq_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            ctx_k.transpose(1, 2),  # [B, Hkv, L, D]
            ctx_v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.squeeze(2)  # [B, H, D]
