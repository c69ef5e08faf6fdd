"""The attention backend contract and the per-step metadata it reads.

A step is one flat, unpadded batch: rows [0, num_decodes) are decodes (one
query token each), the remaining rows are prefill chunks whose first
`num_computed[i]` tokens are already in the paged cache.

```text
 row i:  | cached context (num_computed) | this chunk (query_len) |
          <-------------------- seq_len ------------------------->
 query i attends to every cached token and causally inside its chunk
```

Layers with a sliding window read a second paged pool through their own
metadata (`AttentionMetadata.window`): the window pool's block table and
slots, with `sliding_window` set; a query there sees only the last
`sliding_window` positions up to itself, and the table's entries behind
every window of the row point at blocks that must not be read.

Linear-attention layers (a hybrid model's) read `state_slots` instead: each
row's slot in the state pool, which holds the state after its computed
tokens.

A family whose image tokens attend to each other in both directions
(Gemma 3) gives, per row, the position ranges of its images
(`image_spans`): a query inside one also sees the keys after it up to the
image's end (all in the cache: the scheduler never ends a chunk inside an
image), and a window still bounds what it sees behind.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

# One layer's paged KV cache: (keys, values).
KvCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64, KV slot of each new token
    block_table: torch.Tensor  # [B, W] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    # Host copies for the backends that loop or size buffers on the CPU.
    query_start_loc_cpu: np.ndarray  # [B + 1]
    seq_lens_cpu: np.ndarray  # [B]
    num_computed_cpu: np.ndarray  # [B]
    max_query_len: int
    max_seq_len: int
    block_table_cpu: np.ndarray | None = None  # [B, W] int32, host copy
    # Of a window pool's metadata: the window (0 for full attention).
    sliding_window: int = 0
    # Of the full pool's metadata, for a model with sliding-window layers:
    # the window pool's (same rows and positions, its own table and slots).
    window: "AttentionMetadata | None" = None
    # Of a model with recurrent-state layers: each row's state slot [B]
    # (int64), on the device and on the host; a row with no computed tokens
    # starts its slot from zero.
    state_slots: torch.Tensor | None = None
    state_slots_cpu: np.ndarray | None = None
    # Of a family with bidirectional image attention: each row with images
    # in this step -> the [start, end) positions of those images.
    image_spans: dict[int, list[tuple[int, int]]] | None = None
    # What the linear-attention layers derive from the above, once a step
    # (layers/gated_delta.py).
    _state_rows: object = field(default=None, repr=False)
    _row_split: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = field(
        default=None, repr=False
    )

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    def row_split(
        self, max_short: int = 1, max_short_after_context: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """(short rows, the other rows), int32. Short: at most `max_short`
        query tokens, or at most `max_short_after_context` after a context
        computed before (a cached prefix, earlier chunks).

        Short rows (decodes, a speculative verification's few positions, the
        tail of a prompt behind a cache hit) suit a kernel that streams each
        row's cached keys; long rows (prefill chunks) suit matrix-multiply
        attention."""
        key = (max_short, max_short_after_context)
        if self._row_split is None or self._row_split[0] != key:
            num_sched = np.diff(self.query_start_loc_cpu)
            short = num_sched <= max_short
            if max_short_after_context > max_short:
                after = np.asarray(self.seq_lens_cpu) > num_sched
                short |= after & (num_sched <= max_short_after_context)
            self._row_split = (
                key,
                np.flatnonzero(short).astype(np.int32),
                np.flatnonzero(~short).astype(np.int32),
            )
        return self._row_split[1], self._row_split[2]


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache and attends over it.

    Caches are per layer, `[num_blocks, block_size, num_kv_heads, head_dim]`.
    """

    name: ClassVar[str]
    # Whether `forward` honours `AttentionMetadata.sliding_window` (reading
    # nothing behind a window). Without it a model's context is capped at
    # its window, inside which sliding and full attention agree.
    supports_sliding_window: ClassVar[bool] = False
    # Whether `forward` takes attention sinks (gpt-oss: per query head, a
    # logit in each softmax's denominator with no value).
    supports_sinks: ClassVar[bool] = False
    # Whether `forward` honours `AttentionMetadata.image_spans`.
    supports_image_spans: ClassVar[bool] = False
    # Whether a decode step can be captured in a CUDA graph: the forward must
    # read no host-side metadata and launch work sized by static bounds only.
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        return True

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, BS, Hkv, D]
        v_cache: torch.Tensor,  # [N, BS, Hkv, D]
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [H] float32, where supports_sinks
    ) -> torch.Tensor:  # [T, H, D]
        ...
