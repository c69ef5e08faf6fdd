"""The step message of tensor parallelism: rank 0 broadcasts the part of
each BatchPlan that every rank's forward pass reads (a fixed header and one
flat int64 payload over a gloo group: no pickle), an order to load or drop a
LoRA adapter, or the order to stop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ferrox.parallel.state import state

_STOP, _STEP, _ADAPTER = 0, 1, 2
ADAPTER_LOAD, ADAPTER_REMOVE = 1, 2
# The plan's arrays a step needs on every rank, in payload order.
PLAN_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_table",
    "query_start_loc",
    "seq_lens",
    "num_computed_tokens",
    "num_scheduled_tokens",
    "logits_indices",
    "window_slot_mapping",  # (empty without a window pool)
    "window_block_table",
    "adapters",  # each row's LoRA adapter (0: none)
    "kv_copy_src",  # (empty without partial-block copies)
    "kv_copy_dst",
)
_FIELD_DTYPES = {
    "input_ids": np.int64,
    "positions": np.int64,
    "slot_mapping": np.int64,
    "block_table": np.int32,
    "query_start_loc": np.int32,
    "seq_lens": np.int32,
    "num_computed_tokens": np.int32,
    "num_scheduled_tokens": np.int32,
    "logits_indices": np.int64,
    "window_slot_mapping": np.int64,
    "window_block_table": np.int32,
    "adapters": np.uint32,
    "kv_copy_src": np.int64,
    "kv_copy_dst": np.int64,
}
# kind, num_reqs, num_decodes, num_tokens, block table columns, prompt rows,
# then the length of each field
_HEADER_LEN = 6 + len(PLAN_FIELDS)


@dataclass
class StepPlan:
    """The part of a BatchPlan every rank's forward pass reads."""

    num_reqs: int
    num_decodes: int
    num_tokens: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_table: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    logits_indices: np.ndarray
    window_slot_mapping: np.ndarray | None = None
    window_block_table: np.ndarray | None = None
    adapters: np.ndarray | None = None
    kv_copy_src: np.ndarray | None = None
    kv_copy_dst: np.ndarray | None = None
    # (models with recurrent state run on one rank: never sent)
    state_slots: np.ndarray | None = None
    state_restores: np.ndarray | None = None
    state_saves: np.ndarray | None = None


@dataclass(frozen=True)
class AdapterOrder:
    """Load the LoRA adapter at `path` under id `adapter`, or drop it."""

    op: int  # ADAPTER_LOAD or ADAPTER_REMOVE
    adapter: int
    path: str = ""


def _broadcast_header(header: np.ndarray) -> None:
    dist.broadcast(torch.from_numpy(header), src=0, group=state().control)


def send_stop() -> None:
    """Rank 0: tells every worker to leave its step loop."""
    _broadcast_header(np.array([_STOP] + [0] * (_HEADER_LEN - 1), dtype=np.int64))


def send_adapter(op: int, adapter: int, path: str = "") -> None:
    """Rank 0: every worker loads (or drops) a LoRA adapter, as rank 0 did."""
    raw = np.frombuffer(path.encode(), dtype=np.uint8).astype(np.int64)
    header = np.zeros(_HEADER_LEN, dtype=np.int64)
    header[:4] = (_ADAPTER, op, adapter, raw.size)
    _broadcast_header(header)
    dist.broadcast(torch.from_numpy(raw), src=0, group=state().control)


def send_step(plan: Any, prompt_rows: list[tuple[int, int, int]] | None) -> None:
    """Rank 0: the step's plan (and prompt-logprob rows) to every worker."""
    arrays = [
        np.ascontiguousarray(
            np.zeros(0, dtype=_FIELD_DTYPES[name])
            if getattr(plan, name, None) is None
            else getattr(plan, name)
        )
        for name in PLAN_FIELDS
    ]
    rows = np.asarray(prompt_rows or [], dtype=np.int64).reshape(-1)
    header = np.array(
        [
            _STEP,
            plan.num_reqs,
            plan.num_decodes,
            plan.num_tokens,
            plan.block_table.shape[1] if plan.block_table.ndim == 2 else 0,
            len(rows) // 3,
            *(a.size for a in arrays),
        ],
        dtype=np.int64,
    )
    _broadcast_header(header)
    payload = np.concatenate([a.reshape(-1).astype(np.int64) for a in arrays] + [rows])
    dist.broadcast(torch.from_numpy(payload), src=0, group=state().control)


def receive_step() -> tuple[StepPlan, list[tuple[int, int, int]]] | AdapterOrder | None:
    """A worker: the next step, an adapter order, or None when rank 0 stops."""
    header_t = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header_t, src=0, group=state().control)
    header = header_t.numpy()
    if header[0] == _STOP:
        return None
    if header[0] == _ADAPTER:
        raw_t = torch.empty(int(header[3]), dtype=torch.int64)
        dist.broadcast(raw_t, src=0, group=state().control)
        path = raw_t.numpy().astype(np.uint8).tobytes().decode()
        return AdapterOrder(int(header[1]), int(header[2]), path)
    num_reqs, num_decodes, num_tokens, width, num_rows = (int(v) for v in header[1:6])
    sizes = [int(v) for v in header[6:]]
    payload_t = torch.empty(sum(sizes) + 3 * num_rows, dtype=torch.int64)
    dist.broadcast(payload_t, src=0, group=state().control)
    payload = payload_t.numpy()
    fields: dict[str, np.ndarray] = {}
    offset = 0
    for name, n in zip(PLAN_FIELDS, sizes, strict=True):
        fields[name] = payload[offset : offset + n].astype(_FIELD_DTYPES[name])
        offset += n
    fields["block_table"] = (
        fields["block_table"].reshape(-1, width)
        if width
        else np.zeros((num_reqs, 0), dtype=np.int32)
    )
    windowed = fields["window_slot_mapping"].size > 0
    table = fields.pop("window_block_table")
    slots = fields.pop("window_slot_mapping")
    rows = payload[offset:].reshape(-1, 3).tolist()
    plan = StepPlan(
        num_reqs,
        num_decodes,
        num_tokens,
        **fields,
        window_slot_mapping=slots if windowed else None,
        window_block_table=table.reshape(-1, width) if windowed else None,
    )
    return plan, [(int(r), int(k), int(t)) for r, k, t in rows]
