"""The engine's torch profiler (CPU, and CUDA on a GPU): started and stopped
on request, a Chrome trace per profile."""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from ferrox.common.errors import InvalidArgumentError

logger = logging.getLogger("ferrox")


class EngineProfiler:
    def __init__(self, folder: str | None, device: torch.device) -> None:
        """`folder`: where traces go; None: profiling is off."""
        self._folder = folder
        self._device = device
        self._profiler: Any = None

    @property
    def is_running(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        if self._folder is None:
            raise InvalidArgumentError("profiling is off: give profiler_dir (--profiler-dir)")
        if self._profiler is not None:
            raise InvalidArgumentError("a profile is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()
        atexit.register(self.close)  # a profile left running crashes torch at exit

    def stop(self) -> Path:
        """Stops the profiler; returns the Chrome trace file it wrote (open it
        in Perfetto or chrome://tracing)."""
        if self._profiler is None or self._folder is None:
            raise InvalidArgumentError("no profile is running")
        profiler, self._profiler = self._profiler, None
        atexit.unregister(self.close)
        profiler.stop()
        folder = Path(self._folder)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = folder / f"ferrox-engine-{os.getpid()}-{stamp}-{time.monotonic_ns()}.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
        except OSError as e:
            raise InvalidArgumentError(f"cannot write the profile to {folder}: {e}") from e
        logger.info("profile written to %s", path)
        return path

    def close(self) -> None:
        """Stops a profile still running (torch crashes at process exit
        under a running profiler); its trace is discarded."""
        atexit.unregister(self.close)
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
            logger.warning("a profile was still running at shutdown; its trace is discarded")
