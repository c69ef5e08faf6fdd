"""Tensor parallelism over torch.distributed (gloo on the CPU, NCCL on GPUs).

The engine process is rank 0: it runs the one Rust scheduler and samples.
Ranks 1..N-1 are worker processes it starts (`python -m ferrox.worker`);
each loads only its shard of the weights (its share of the attention heads,
of the MLP's intermediate width and of the vocabulary) and holds the KV cache
of its heads. Every step rank 0 broadcasts the batch plan (a fixed header
and one flat int64 payload over a gloo group: no pickle), then every rank
runs the same forward pass: row-parallel projections (o_proj, down_proj) and
the vocab-parallel embedding end in an all-reduce, the vocab-parallel LM head
in an all-gather.

`state()` is this process's rank and world size; the model code asks it for
its shard sizes (`attention_shard`, `vocab_shard`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ferrox.errors import EngineDeadError, InvalidArgumentError

logger = logging.getLogger("ferrox.distributed")

# How long a collective may wait for a rank before it fails (a dead worker
# then fails the step instead of hanging the engine).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
WORKER_START_TIMEOUT_S = 300.0
_STOP, _STEP = 0, 1
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
}
# kind, num_reqs, num_decodes, num_tokens, block table columns, prompt rows,
# then the length of each field
_HEADER_LEN = 6 + len(PLAN_FIELDS)


@dataclass
class ParallelState:
    rank: int = 0
    size: int = 1
    control: Any = None  # the gloo group the step broadcast runs on
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    store_dir: str | None = None


_state = ParallelState()


def state() -> ParallelState:
    return _state


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, in place (x itself when there is one rank)."""
    if _state.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x, concatenated along the last dimension, rank order."""
    if _state.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class AttentionShard:
    """This rank's query heads [q_first, q_first + num_heads) and KV heads
    [kv_first, kv_first + num_kv_heads)."""

    num_heads: int
    num_kv_heads: int
    q_first: int
    kv_first: int


def attention_shard(num_heads: int, num_kv_heads: int) -> AttentionShard:
    """Query heads split evenly; KV heads split too, or, when there are
    fewer than ranks, each rank keeps the one its query heads read."""
    size, rank = _state.size, _state.rank
    if num_heads % size:
        raise InvalidArgumentError(
            f"tensor_parallel_size={size} must divide the model's {num_heads} attention heads"
        )
    heads = num_heads // size
    if num_kv_heads % size == 0:
        kv = num_kv_heads // size
        return AttentionShard(heads, kv, rank * heads, rank * kv)
    if size % num_kv_heads == 0:
        return AttentionShard(heads, 1, rank * heads, rank * num_kv_heads // size)
    raise InvalidArgumentError(
        f"tensor_parallel_size={size} and the model's {num_kv_heads} KV heads: one must divide "
        "the other"
    )


def even_shard(total: int, what: str) -> tuple[int, int]:
    """(first, count) of this rank's equal share of `total`."""
    if total % _state.size:
        raise InvalidArgumentError(
            f"tensor_parallel_size={_state.size} must divide the model's {what} ({total})"
        )
    count = total // _state.size
    return _state.rank * count, count


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first row, rows held) of the vocabulary: ceil(V / N) rows a rank, the
    last rank's padded beyond V."""
    rows = -(-vocab_size // _state.size)
    return _state.rank * rows, rows


# ---------------------------------------------------------------- processes


def start(size: int, options: dict[str, Any], device: torch.device) -> None:
    """On rank 0 (the engine process): starts the workers and joins the group
    (`stop` undoes it, at the latest when the process exits)."""
    if _state.size > 1:
        raise InvalidArgumentError("this process already runs a tensor-parallel engine")
    if device.type == "cuda":
        available, what = torch.cuda.device_count(), "GPUs"
    else:
        available, what = os.cpu_count() or 1, "CPU cores"
    if size > available:
        raise InvalidArgumentError(
            f"tensor_parallel_size={size} exceeds the {available} {what} of this machine "
            "(one rank each)"
        )
    store_dir = tempfile.mkdtemp(prefix="ferrox-tp-")
    init = f"file://{store_dir}/rendezvous"
    payload = json.dumps(options)
    workers = []
    for rank in range(1, size):
        cmd = [sys.executable, "-m", "ferrox.worker", str(rank), str(size), init]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(payload.encode())
        proc.stdin.close()
        workers.append(proc)
    _state.workers = workers
    _state.store_dir = store_dir
    atexit.register(stop)
    try:
        _join(0, size, init, device, timeout=WORKER_START_TIMEOUT_S)
    except Exception:
        stop()
        raise


def _join(rank: int, size: int, init: str, device: torch.device, timeout: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
    )
    control = None  # the step broadcast: the default group on the CPU, a gloo one beside NCCL
    if backend != "gloo":
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    _state.rank, _state.size = rank, size
    _state.control = control
    if device.type == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def join_as_worker(rank: int, size: int, init: str, device: torch.device) -> None:
    _watch_parent()  # from the start: rank 0 may die before the group forms
    _join(rank, size, init, device, timeout=WORKER_START_TIMEOUT_S)


def stop() -> None:
    """Rank 0: tells the workers to exit, waits for them, leaves the group
    (nothing to do without workers)."""
    atexit.unregister(stop)
    workers, _state.workers = _state.workers, []
    if not workers:  # no tensor-parallel engine here (a group of the caller's stays)
        return
    if dist.is_initialized() and _state.rank == 0:
        try:
            _broadcast_header(np.array([_STOP] + [0] * (_HEADER_LEN - 1), dtype=np.int64))
        except Exception as exc:  # a worker already gone
            logger.warning("could not tell the tensor-parallel workers to stop: %s", exc)
    deadline = time.monotonic() + 10
    for proc in workers:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _leave()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    if _state.store_dir is not None:
        shutil.rmtree(_state.store_dir, ignore_errors=True)
    _state.rank, _state.size, _state.control, _state.store_dir = 0, 1, None, None


def _lost_worker(wait: float = 1.0) -> int | None:
    """Rank 0, after a collective failed: the rank of a worker that has
    exited (waiting up to `wait` seconds for one that is exiting), or None."""
    deadline = time.monotonic() + wait
    while True:
        for rank, proc in enumerate(_state.workers, start=1):
            if proc.poll() is not None:
                return rank
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def raise_if_worker_lost(exc: BaseException) -> None:
    """Rank 0, after a step failed: an EngineDeadError naming the worker
    that has exited, if one has."""
    if _state.size == 1:
        return
    rank = _lost_worker(wait=1.0)
    if rank is not None:
        status = _state.workers[rank - 1].returncode
        raise EngineDeadError(
            f"tensor-parallel worker {rank} exited (status {status}); the engine cannot go on"
        ) from exc


def _watch_parent() -> None:
    """A worker exits when the engine process that started it is gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="ferrox-parent-watch", daemon=True).start()


# ---------------------------------------------------------------- the step message


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


def _broadcast_header(header: np.ndarray) -> None:
    dist.broadcast(torch.from_numpy(header), src=0, group=_state.control)


def send_step(plan: Any, prompt_rows: list[tuple[int, int, int]] | None) -> None:
    """Rank 0: the step's plan (and prompt-logprob rows) to every worker."""
    arrays = [np.ascontiguousarray(getattr(plan, name)) for name in PLAN_FIELDS]
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
    dist.broadcast(torch.from_numpy(payload), src=0, group=_state.control)


def receive_step() -> tuple[StepPlan, list[tuple[int, int, int]]] | None:
    """A worker: the next step, or None when rank 0 stops."""
    header_t = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header_t, src=0, group=_state.control)
    header = header_t.numpy()
    if header[0] == _STOP:
        return None
    num_reqs, num_decodes, num_tokens, width, num_rows = (int(v) for v in header[1:6])
    sizes = [int(v) for v in header[6:]]
    payload_t = torch.empty(sum(sizes) + 3 * num_rows, dtype=torch.int64)
    dist.broadcast(payload_t, src=0, group=_state.control)
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
    rows = payload[offset:].reshape(-1, 3).tolist()
    plan = StepPlan(num_reqs, num_decodes, num_tokens, **fields)
    return plan, [(int(r), int(k), int(t)) for r, k, t in rows]


def worker_main(rank: int, size: int, init: str, options: dict[str, Any]) -> None:
    """A worker process: joins the group, loads its shard, follows rank 0's steps."""
    from ferrox.config import EngineConfig
    from ferrox.engine.core import resolve_max_model_len
    from ferrox.loader.model_loader import load_model
    from ferrox.runner.model_runner import ModelRunner

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    config = EngineConfig.create(**options)
    join_as_worker(rank, size, init, config.torch_device)
    loaded = load_model(config)
    runner = ModelRunner(config, loaded, resolve_max_model_len(config, loaded.hf_config))
    while True:
        step = receive_step()
        if step is None:
            break
        runner.follow(*step)
    _leave()
