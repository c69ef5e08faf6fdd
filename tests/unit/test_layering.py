"""The package's layers hold: no import cycle (imports inside functions and
under TYPE_CHECKING count), the import-linter contracts of pyproject.toml
pass, a deliberately wrong import breaks them, and the server's process
loads no torch."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "ferrox"
LINT_IMPORTS = shutil.which("lint-imports")


def _modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever the import stands.
    `from ferrox import _native` is an import of the native module, not of
    the package root."""
    modules = _modules(package)
    known = set(modules) | {"ferrox._native"}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                    origin = ".".join(parts + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{a.name}" for a in node.names] + [origin]
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
                    break  # `from x import y`: y if it is a module, else x
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert "ferrox.engine.core" in graph  # the graph is read at all
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "ferrox"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "x.py").write_text("def f():\n    from ferrox.b import y\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from ferrox.a.x import f\n")  # fmt: skip
    assert cycles(import_graph(package)) == [["ferrox.a.x", "ferrox.b"]]


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS is not None
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root / "python"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is a dev dependency")
def test_import_contracts_hold() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is a dev dependency")
@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("server/app.py", "import torch\n", "Frontend and server import no torch"),
        ("frontend/output_processor.py", "import ferrox.engine.core\n", "Frontend and server"),
        ("layers/norm.py", "import ferrox.models.llama\n", "Layers, top to bottom"),
        ("engine/sequence.py", "import ferrox.engine.core\n", "The engine process"),
        ("common/outputs.py", "import torch\n", "The contracts and the model files"),
    ],
)
def test_a_wrong_import_breaks_the_contracts(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(PACKAGE, tmp_path / "python" / "ferrox", ignore=shutil.ignore_patterns("*.so"))
    target = tmp_path / "python" / "ferrox" / module
    target.write_text(target.read_text() + "\n" + line)
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout
    assert "BROKEN" in result.stdout


def test_the_server_process_loads_no_torch() -> None:
    code = (
        "import sys\n"
        "import ferrox.server.launch, ferrox.server.app, ferrox.frontend.async_llm\n"
        "print(sorted(m for m in ('torch', 'triton', 'ferrox.engine.core') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_kv_layout_refuses_state_it_does_not_manage() -> None:
    """A family that declares per-layer state the KV pool cannot hold is
    refused with a clear error, never run as if it were full attention."""
    from dataclasses import dataclass

    from ferrox.common.errors import UnsupportedModelError
    from ferrox.models.base import FullAttention
    from ferrox.runner.kv_cache import kv_layout

    @dataclass(frozen=True)
    class SlidingWindow:
        num_kv_heads: int
        head_dim: int
        window: int

    class Model:
        def __init__(self, states: list) -> None:
            self.states = states

        def layer_states(self) -> list:
            return self.states

    assert kv_layout(Model([FullAttention(2, 16)] * 3)) == (3, 2, 16)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="SlidingWindow"):
        kv_layout(Model([FullAttention(2, 16), SlidingWindow(2, 16, 8)]))  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="different KV shapes"):
        kv_layout(Model([FullAttention(2, 16), FullAttention(4, 16)]))  # type: ignore[arg-type]


def test_async_llm_loads_no_server_code() -> None:
    """AsyncLLM is the frontend alone: no HTTP server, no Prometheus."""
    code = (
        "import sys\n"
        "from ferrox import AsyncLLM\n"
        "mods = ('torch', 'prometheus_client', 'starlette', 'ferrox.server.metrics')\n"
        "print(sorted(m for m in mods if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
