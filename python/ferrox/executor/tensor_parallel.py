"""Tensor-parallel worker processes: rank 0 (the engine process) starts
ranks 1..N-1 (`python -m ferrox.executor.worker`), joins their group,
watches them and stops them; a worker follows rank 0's step messages.

Each worker loads only its shard of the weights (`ferrox.parallel.state`
says which) and runs the same forward pass as rank 0, collectives in the same
order; rank 0 samples.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ferrox.common.config import EngineConfig
from ferrox.common.errors import EngineDeadError, InvalidArgumentError
from ferrox.loader.model_loader import load_model, resolve_max_model_len
from ferrox.parallel import state as parallel
from ferrox.parallel.device import torch_device
from ferrox.parallel.step_message import ADAPTER_LOAD, AdapterOrder, receive_step, send_stop
from ferrox.runner.model_runner import ModelRunner

logger = logging.getLogger("ferrox.executor")

WORKER_START_TIMEOUT_S = 300.0


class TensorParallelWorkers:
    """Ranks 1..N-1 of this engine, started by `start` on rank 0."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], store_dir: str) -> None:
        self._procs = procs
        self._store_dir = store_dir

    @classmethod
    def start(
        cls, size: int, options: dict[str, Any], device: torch.device
    ) -> TensorParallelWorkers:
        """Starts the workers and joins the group as rank 0 (`stop` undoes
        it)."""
        if parallel.state().size > 1:
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
        procs = []
        for rank in range(1, size):
            cmd = [sys.executable, "-m", "ferrox.executor.worker", str(rank), str(size), init]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(payload.encode())
            proc.stdin.close()
            procs.append(proc)
        workers = cls(procs, store_dir)
        try:
            parallel.join_group(0, size, init, device, timeout=WORKER_START_TIMEOUT_S)
        except Exception:
            workers.stop()
            raise
        return workers

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return list(self._procs)

    def stop(self) -> None:
        """Tells the workers to exit, waits for them, leaves the group."""
        procs, self._procs = self._procs, []
        if not procs:
            return
        if dist.is_initialized() and parallel.state().rank == 0:
            try:
                send_stop()
            except Exception as exc:  # a worker already gone
                logger.warning("could not tell the tensor-parallel workers to stop: %s", exc)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        parallel.leave_group()
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def lost_worker(self, wait: float = 1.0) -> tuple[int, int | None] | None:
        """After a collective failed: (rank, exit status) of a worker that has
        exited (waiting up to `wait` seconds for one that is exiting), or None."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None:
                    return rank, proc.returncode
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def raise_if_lost(self, exc: BaseException) -> None:
        """After a step failed: an EngineDeadError naming the worker that has
        exited, if one has."""
        lost = self.lost_worker(wait=1.0)
        if lost is not None:
            rank, status = lost
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


def worker_main(rank: int, size: int, init: str, options: dict[str, Any]) -> None:
    """A worker process: joins the group, loads its shard, follows rank 0's steps."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    config = EngineConfig.create(**options)
    _watch_parent()  # from the start: rank 0 may die before the group forms
    parallel.join_group(rank, size, init, torch_device(config), timeout=WORKER_START_TIMEOUT_S)
    loaded = load_model(config)
    runner = ModelRunner(config, loaded, resolve_max_model_len(config, loaded.hf_config))
    while True:
        step = receive_step()
        if step is None:
            break
        if isinstance(step, AdapterOrder):
            if step.op == ADAPTER_LOAD:
                runner.add_adapter(step.adapter, step.path)
            else:
                runner.remove_adapter(step.adapter)
            continue
        runner.follow(*step)
    parallel.leave_group()
