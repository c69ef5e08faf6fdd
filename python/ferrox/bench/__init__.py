"""Benchmarks users can run: `ferrox bench serve` (load against any
OpenAI-compatible server) and `ferrox bench latency` (one batch, no server)."""

from __future__ import annotations

import importlib
from types import ModuleType

from ferrox.common.errors import MissingDependencyError


def require_bench_extra(module: str, purpose: str) -> ModuleType:
    """Imports a package of the `bench` extra, or says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(
            f"{purpose} needs the package {module!r}, which is not installed: "
            "pip install 'ferrox[bench]'"
        ) from e
