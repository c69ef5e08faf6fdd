"""The machine a benchmark ran on, as the result files record it."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ferrox._native import cpu_isa


def write_record(path: str | Path, **figures: Any) -> None:
    """A result file: the command, date, commit and CPU, then `figures`."""
    from baseline import current_commit

    record = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "commit": current_commit(),
        "cpu": cpu_description(),
        **figures,
    }
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def cpu_description() -> dict[str, Any]:
    """The CPU's architecture, core count and vector extensions (AVX2,
    AVX-VNNI, AVX-512, VNNI, AMX-BF16), read from /proc/cpuinfo where there is
    one."""
    flags: set[str] = set()
    model = ""
    numbers: dict[str, str] = {}  # "cpu family" and "model": the core design
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                key = line.split(":", 1)[0].strip()
                if key in ("cpu family", "model") and key not in numbers:
                    numbers[key] = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    return {
        "machine": platform.processor() or platform.machine(),
        "model": model,
        "family": numbers.get("cpu family", ""),
        "model_number": numbers.get("model", ""),
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx_vnni": "avx_vnni" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "amx_bf16": "amx_bf16" in flags,
        # what ferrox's kernels use: the CPU's widest, or FERROX_CPU_ISA's cap
        "ferrox_isa": cpu_isa(),
    }


def spread(values: list[float], unit: str = "", digits: int = 1) -> str:
    """median (min-max) of `values`."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"
