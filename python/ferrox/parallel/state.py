"""This process's place in a tensor-parallel group (torch.distributed: gloo
on the CPU, NCCL on GPUs): its rank and the group's size, the collectives the
model code calls, and the shard of each weight a rank holds.

The engine process is rank 0: it runs the one Rust scheduler and samples.
Ranks 1..N-1 are worker processes (`ferrox.executor.tensor_parallel` starts
and watches them); each loads only its shard of the weights (its share of the
attention heads, of the MLP's intermediate width and of the vocabulary) and
holds the KV cache of its heads. Row-parallel projections (o_proj,
down_proj) and the vocab-parallel embedding end in an all-reduce, the
vocab-parallel LM head in an all-gather.

`state()` is this process's rank and world size; the model code asks it for
its shard sizes (`attention_shard`, `vocab_shard`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ferrox.common.errors import InvalidArgumentError

# How long a collective may wait for a rank before it fails (a dead worker
# then fails the step instead of hanging the engine).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass
class ParallelState:
    rank: int = 0
    size: int = 1
    control: Any = None  # the gloo group the step broadcast runs on


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


def join_group(rank: int, size: int, init: str, device: torch.device, timeout: float) -> None:
    """Joins the group of `size` ranks that meet at `init` as `rank`."""
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


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.rank, _state.size, _state.control = 0, 1, None
