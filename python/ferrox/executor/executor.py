"""Executor: where a step's forward pass runs, in this process alone or in
this process and its tensor-parallel workers. It is the only code that
starts, watches and stops worker processes: the engine hands it a plan and
gets the sampled tokens back, whatever the number of ranks.
"""

from __future__ import annotations

import atexit
import subprocess
from collections.abc import Callable

import torch

from ferrox._native import BatchPlan
from ferrox.common.config import EngineConfig
from ferrox.common.errors import EngineDeadError, IntegrityError, InvalidArgumentError
from ferrox.common.multimodal import StepImages
from ferrox.executor.tensor_parallel import TensorParallelWorkers
from ferrox.loader.model_loader import LoadedModel, load_model, resolve_max_model_len
from ferrox.parallel.device import torch_device
from ferrox.parallel.step_message import ADAPTER_LOAD, ADAPTER_REMOVE, send_adapter, send_step
from ferrox.runner.model_runner import ModelRunner, RunnerOutput
from ferrox.runner.sampling_batch import SamplingBatch


class Executor:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        load_draft: Callable[[LoadedModel], LoadedModel | None] | None = None,
    ) -> None:
        """Loads the model (rank 0's shard under tensor parallelism, once the
        workers have joined), and, through `load_draft`, the draft model of
        speculative decoding, whose KV cache shares the target's blocks."""
        self.config = config
        self._workers: TensorParallelWorkers | None = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise InvalidArgumentError("a tensor-parallel engine loads its own shards")
            options = {name: getattr(config, name) for name in EngineConfig.field_names()}
            self._workers = TensorParallelWorkers.start(
                config.tensor_parallel_size, options, torch_device(config)
            )
            atexit.register(self.close)
        try:
            self.loaded = loaded or load_model(config)
            self.max_model_len = resolve_max_model_len(config, self.loaded.hf_config)
            if config.seed is not None:
                torch.manual_seed(config.seed)
            draft = load_draft(self.loaded) if load_draft is not None else None
            self.runner = ModelRunner(config, self.loaded, self.max_model_len, draft)
        except BaseException:
            self.close()
            raise

    def execute(
        self,
        plan: BatchPlan,
        sampling: SamplingBatch,
        prompt_logprob_rows: list[tuple[int, int, int]] | None = None,
        pool_rows: list[int] | None = None,
        images: StepImages | None = None,
    ) -> RunnerOutput:
        """Runs one step on every rank; rank 0 samples and pools (see
        ModelRunner.execute). `images`: the step's image inputs (a
        vision-language model runs on one rank)."""
        try:
            if self._workers is not None:
                send_step(plan, prompt_logprob_rows)
            return self.runner.execute(plan, sampling, prompt_logprob_rows, pool_rows, images)
        except RuntimeError as exc:
            if self._workers is not None:
                self._workers.raise_if_lost(exc)
            raise

    def add_adapter(self, adapter: int, path: str) -> None:
        """Loads a LoRA adapter on every rank (each its shard); rank 0
        first, so that a bad adapter stops there."""
        self.runner.add_adapter(adapter, path)
        if self._workers is not None:
            send_adapter(ADAPTER_LOAD, adapter, path)

    def remove_adapter(self, adapter: int) -> None:
        self.runner.remove_adapter(adapter)
        if self._workers is not None:
            send_adapter(ADAPTER_REMOVE, adapter)

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether an error in a step ends the engine (see `is_fatal`)."""
        return is_fatal(exc, tensor_parallel=self._workers is not None)

    def worker_processes(self) -> list[subprocess.Popen[bytes]]:
        """The tensor-parallel workers (ranks 1..N-1); none with one rank."""
        return [] if self._workers is None else self._workers.processes()

    def close(self) -> None:
        """Stops the tensor-parallel workers (nothing to do without them)."""
        atexit.unregister(self.close)
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.stop()


def is_fatal(exc: BaseException, tensor_parallel: bool = False) -> bool:
    """Whether an error in a step may have corrupted state that other
    requests share: a broken scheduler invariant, exhausted host memory, an
    error of the GPU (a failed kernel leaves the device context unusable), or
    a lost tensor-parallel worker."""
    if isinstance(exc, (IntegrityError, MemoryError, EngineDeadError)):
        return True
    name = type(exc).__name__
    if name == "AcceleratorError" or "CUDA error" in str(exc) or "device-side" in str(exc):
        return True
    if not tensor_parallel:
        return False
    # Under tensor parallelism a failed collective leaves the ranks out of
    # step (a lost worker is an EngineDeadError already: `Executor.execute`).
    return isinstance(exc, torch.distributed.DistError) or any(
        s in str(exc) for s in ("gloo", "NCCL", "Connection closed")
    )
