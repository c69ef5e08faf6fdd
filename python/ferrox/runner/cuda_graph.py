"""CUDA graphs for decode steps.

A decode-only step of n requests is padded to the smallest bucket >= n
(1, 2, 4, 8, then steps of 8 up to max_num_seqs) and replayed from a graph
captured once per bucket. Inputs live in static buffers; padded rows have
`seq_len` 0 and KV slot -1, so they read nothing and write nothing.
Prefill steps and batches above the largest bucket run eagerly.

Every bucket is run once eagerly before any capture: kernel variants that
depend on the batch size (the decode split count of the paged-attention
kernel is a compile-time constant) are compiled outside capture. The logits
of every bucket land in one static float32 buffer of the largest bucket's
rows, so graph memory does not grow with the number of buckets.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ferrox.layers.attention import AttentionMetadata
from ferrox.models.base import CausalLM


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_num_seqs: int,
        max_model_len: int,
        vocab_size: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.device = device
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(max_num_seqs)
        n, width = self.sizes[-1], -(-max_model_len // block_size)
        self.width = width
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits = torch.empty(n, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the graphs' shared memory pool, after the first capture

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _metadata(self, b: int) -> AttentionMetadata:
        # Host-side fields are not read on the decode path; max_seq_len is
        # the static bound the kernels' launch grid is built from.
        return AttentionMetadata(
            num_reqs=b,
            num_decodes=b,
            num_tokens=b,
            slot_mapping=self.slot_mapping[:b],
            block_table=self.block_table[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            query_start_loc_cpu=np.arange(b + 1, dtype=np.int32),
            seq_lens_cpu=np.ones(b, dtype=np.int32),
            num_computed_cpu=np.zeros(b, dtype=np.int32),
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    @staticmethod
    def logits_bytes(max_num_seqs: int, vocab_size: int) -> int:
        """Bytes of the static logits buffer (for the KV cache's budget)."""
        return bucket_sizes(max_num_seqs)[-1] * vocab_size * 4

    def _forward(self, b: int) -> None:
        hidden = self.model(
            self.input_ids[:b], self.positions[:b], self.kv_layers, self._metadata(b)
        )
        self.logits[:b].copy_(self.model.compute_logits(hidden))  # [b, V]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, in one shared memory pool."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm up outside capture: compile every batch-size-dependent
            # kernel variant, and autotune, before any graph records.
            for b in reversed(self.sizes):
                self._forward(b)
            self._forward(self.sizes[-1])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._forward(b)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def bucket_for(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64, on the device
        positions: torch.Tensor,  # [n]
        slot_mapping: torch.Tensor,  # [n]
        seq_lens: torch.Tensor,  # [n] int32
        block_table: torch.Tensor,  # [n, w] int32, w <= width
    ) -> torch.Tensor:  # [n, V] logits
        n, w = block_table.shape
        b = self.bucket_for(n)
        if b is None or w > self.width:
            raise ValueError(f"no graph for {n} decodes of {w} blocks")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:b].zero_()
        self.block_table[:n, :w].copy_(block_table)
        self.graphs[b].replay()
        return self.logits[:n]
