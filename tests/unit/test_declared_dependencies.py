"""Every third-party package the code imports is declared in pyproject.toml.

A package that is merely present on the machine (installed by hand, or pulled
in by something else) passes every other test and then fails a fresh install;
this test reads the imports and the declarations instead:

    python/ferrox, imported when its module loads  -> [project] dependencies
    python/ferrox, imported inside a function/try  -> dependencies or an extra
    tests/ and benches/                            -> dependencies or the dev extra
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # the top-level name, e.g. "matplotlib"
    eager: bool  # runs when the module is imported


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"cannot read the package name of {requirement!r}")
    return normalise(match.group(1))


def declared(pyproject: dict) -> tuple[set[str], dict[str, set[str]]]:
    """The runtime dependencies, and each extra with the extras it names expanded."""
    project = pyproject["project"]
    own = normalise(project["name"])
    runtime = {requirement_name(r) for r in project.get("dependencies", [])}
    raw = project.get("optional-dependencies", {})

    def expand(extra: str, seen: frozenset[str] = frozenset()) -> set[str]:
        names: set[str] = set()
        for requirement in raw[extra]:
            name = requirement_name(requirement)
            if name == own:  # "ferrox[bench]": the extras it names
                inner = re.search(r"\[(.*?)\]", requirement)
                for sub in inner.group(1).split(",") if inner else []:
                    sub = sub.strip()
                    if sub not in seen:
                        names |= expand(sub, seen | {extra})
            else:
                names.add(name)
        return names

    return runtime, {extra: expand(extra) for extra in raw}


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(
                    Import(path, child.lineno, a.name.split(".")[0], eager) for a in child.names
                )
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append(Import(path, child.lineno, child.module.split(".")[0], eager))
            else:
                # Inside a function, class body method, try or if, an import is
                # conditional or deferred; only module-level statements are eager.
                nested = isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Try, ast.If)
                )
                visit(child, eager and not nested)

    visit(tree, True)
    return found


@cache
def installed_modules() -> dict[str, list[str]]:
    return packages_distributions()  # reads every installed distribution: once


def distributions(module: str) -> set[str]:
    """The distributions that provide a top-level module; its own name when
    none installed here does (an optional GPU package, say)."""
    names = installed_modules().get(module) or [module]
    return {normalise(n) for n in names}


def undeclared(pyproject: dict, root: Path) -> list[str]:
    """One line per import that pyproject.toml does not account for."""
    runtime, extras = declared(pyproject)
    any_extra = runtime.union(*extras.values())
    dev = runtime | extras.get("dev", set())
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    problems = []
    for path in sorted((root / "python" / "ferrox").rglob("*.py")):
        for imp in imports_of(path):
            if imp.module in stdlib or imp.module == "ferrox":
                continue
            allowed = runtime if imp.eager else any_extra
            if not distributions(imp.module) & allowed:
                where = "dependencies" if imp.eager else "dependencies or an extra"
                problems.append(
                    f"{path.relative_to(root)}:{imp.line}: {imp.module} is not in {where}"
                )
    # A peer a benchmark runs in the peer's own environment, never beside ferrox.
    peers = {"benches/vs_vllm.py": {"vllm"}}
    for folder in ("tests", "benches"):
        # (a benchmark may use the checkout's test helpers: tests/models.py's tiny models)
        local = {p.stem for p in (root / folder).glob("*.py")} | {folder, "tests"}
        for path in sorted((root / folder).rglob("*.py")):
            for imp in imports_of(path):
                if imp.module in stdlib or imp.module in local or imp.module == "ferrox":
                    continue
                if imp.module in peers.get(path.relative_to(root).as_posix(), ()):
                    continue
                if not distributions(imp.module) & dev:
                    problems.append(
                        f"{path.relative_to(root)}:{imp.line}: {imp.module} is not in the dev extra"
                    )
    return problems


def test_every_import_is_declared() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert undeclared(pyproject, ROOT) == []


def test_an_undeclared_import_is_found() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    project["dependencies"] = [
        r for r in project["dependencies"] if requirement_name(r) != "msgspec"
    ]
    extras = project["optional-dependencies"]
    extras["bench"] = []
    extras["dev"] = [r for r in extras["dev"] if requirement_name(r) != "openai"]
    problems = undeclared(pyproject, ROOT)
    assert any(": msgspec is not in dependencies" in p for p in problems)
    # A lazy import needs an extra, and the tests need the dev extra.
    assert any(": matplotlib is not in dependencies or an extra" in p for p in problems)
    assert any(p.startswith("tests/") and ": openai is not in the dev extra" in p for p in problems)


def test_lazy_imports_are_told_apart(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import numpy\n"
        "try:\n    import yaml\nexcept ImportError:\n    yaml = None\n"
        "def f():\n    import matplotlib\n"
    )
    assert [(i.module, i.eager) for i in imports_of(source)] == [
        ("numpy", True),
        ("yaml", False),
        ("matplotlib", False),
    ]
