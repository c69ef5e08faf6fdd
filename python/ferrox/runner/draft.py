"""The draft model of speculative decoding: a smaller model with the target's
vocabulary, run by the same kind of runner with a KV cache of its own.

Its cache has the target's blocks: the same block ids and slots hold the
draft's K/V of the same tokens, so the scheduler's block tables and prefix
cache serve both. The draft catches up lazily: each sequence remembers up to
where the draft's KV is valid (`draft_synced`), and a step first feeds the
tokens since then (usually one or two) before proposing. A position the
draft got wrong only lowers acceptance; verification stays exact.

Per step, for the rows the scheduler gave draft positions:

    pass 1: each row's unsynced tokens up to its pending token -> draft 1
    pass i: draft i - 1 at its position                        -> draft i
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ferrox._native import BatchPlan
from ferrox.layers.attention import AttentionMetadata
from ferrox.loader.model_loader import LoadedModel
from ferrox.runner.kv_cache import KVCache, bytes_per_block, kv_layout
from ferrox.runner.sampler import greedy_tokens


class DraftRunner:
    def __init__(
        self, loaded: LoadedModel, block_size: int, kv_dtype: torch.dtype, device: torch.device
    ):
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.block_size = block_size
        self.kv_dtype = kv_dtype  # its KV cache's, as the target's
        self.device = device
        self.num_layers, self.num_kv_heads, self.head_dim = kv_layout(self.model)
        self.kv_cache: KVCache | None = None

    def bytes_per_block(self) -> int:
        return bytes_per_block(
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.kv_dtype,
        )

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV cache, with as many blocks as the target's."""
        self.kv_cache = KVCache(
            self.num_layers,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.kv_dtype,
            self.device,
        )

    @torch.inference_mode()
    def propose(
        self, plan: BatchPlan, tokens: Sequence[list[int]], synced: list[int]
    ) -> np.ndarray:
        """Fills the plan's draft positions (in `plan.input_ids`) with the
        draft model's greedy continuation; returns the drafts, rows in order.

        tokens[r]: row r's prompt + output tokens (rows with drafts only, in
        plan order); synced[r]: how many of them have valid draft KV, updated
        in place."""
        assert self.kv_cache is not None, "allocate() first"
        rows = np.flatnonzero(plan.num_draft_tokens).tolist()
        d = plan.num_draft_tokens[rows].astype(np.int64)
        qsl = plan.query_start_loc
        computed = plan.num_computed_tokens[rows].astype(np.int64)
        tables = plan.block_table[rows]
        drafts = np.zeros((len(rows), int(d.max())), dtype=np.int64)
        # Pass 1: catch up to and including the pending token.
        starts = np.minimum(np.asarray(synced, dtype=np.int64), computed)
        chunks = [
            np.asarray(tokens[i][int(s) : int(c) + 1], dtype=np.int64)
            for i, (s, c) in enumerate(zip(starts, computed, strict=True))
        ]
        last = self._forward(chunks, starts, tables)
        drafts[:, 0] = last
        # Passes 2..: one token per row that still needs drafts.
        for i in range(1, drafts.shape[1]):
            live = np.flatnonzero(d > i)
            if len(live) == 0:
                break
            chunks = [drafts[j, i - 1 : i] for j in live.tolist()]
            drafts[live, i] = self._forward(chunks, computed[live] + i, tables[live])
        flat = []
        for j, row in enumerate(rows):
            n = int(d[j])
            start = int(qsl[row]) + 1
            plan.input_ids[start : start + n] = drafts[j, :n]
            flat.append(drafts[j, :n])
            # Valid after this step: everything fed (the pending token and
            # drafts 1..n-1 at their positions, if they are accepted).
            synced[j] = int(computed[j]) + n
        return np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)

    def _forward(
        self, chunks: list[np.ndarray], starts: np.ndarray, tables: np.ndarray
    ) -> np.ndarray:
        """Runs the draft over each row's chunk starting at position starts[r]
        (rows of one token first, as the attention backends expect); returns
        each row's greedy next token."""
        lens = np.array([len(c) for c in chunks], dtype=np.int32)
        order = np.argsort(lens != 1, kind="stable")
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        lens = lens[order]
        starts = np.asarray(starts, dtype=np.int64)[order]
        tables = np.ascontiguousarray(tables[order], dtype=np.int32)
        ids = np.concatenate([chunks[i] for i in order.tolist()])
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
        row_of = np.repeat(np.arange(len(lens)), lens)
        bs = self.block_size
        slots = tables[row_of, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        seq_lens = (starts + lens).astype(np.int32)
        dev = self.device
        meta = AttentionMetadata(
            num_reqs=len(lens),
            num_decodes=int((lens == 1).sum()),
            num_tokens=len(ids),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_table=torch.from_numpy(tables).to(dev),
            block_table_cpu=tables,
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            num_computed_cpu=starts.astype(np.int32),
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        assert self.kv_cache is not None
        hidden = self.model(
            torch.from_numpy(ids).to(dev),
            torch.from_numpy(positions).to(dev),
            self.kv_cache.layers,
            meta,
        )
        logits = self.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).to(dev)])
        next_tokens = greedy_tokens(logits).cpu().numpy()
        return next_tokens[inverse]
