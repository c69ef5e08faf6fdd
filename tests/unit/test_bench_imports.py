"""Every name a benchmark script imports from ferrox exists: the scripts run
only by hand, so a moved function would otherwise show up as an ImportError
on the next measurement (often inside a branch a cached file had skipped)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[2] / "benches"


def _missing(module: str, name: str) -> bool:
    if hasattr(importlib.import_module(module), name):
        return False
    try:
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return True
    return False


def test_benchmarks_import_names_that_exist() -> None:
    scripts = sorted(BENCHES.glob("*.py"))
    assert scripts
    missing = [
        f"{script.name}: from {node.module} import {alias.name}"
        for script in scripts
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ferrox"
        for alias in node.names
        if _missing(node.module or "", alias.name)
    ]
    assert not missing, missing
