"""The code at another git revision, built beside the current tree, for
benchmarks that run both side by side (`--baseline REF`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def add_worktree(ref: str, folder: Path) -> None:
    """A worktree of `ref` at `folder` (`remove_baseline` takes it away)."""
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), ref], cwd=ROOT, check=True)


def build_baseline(ref: str, folder: Path) -> Path:
    """A worktree of `ref` with its native module built in place; returns its
    python/ (for PYTHONPATH)."""
    add_worktree(ref, folder)
    # A target folder of its own keeps the current tree's build untouched.
    env = dict(os.environ, CARGO_TARGET_DIR=str(ROOT / "target" / "baseline"))
    wheels = folder / "wheels"
    subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "-o", str(wheels)],
        cwd=folder,
        env=env,
        check=True,
    )
    with zipfile.ZipFile(next(wheels.glob("*.whl"))) as wheel:
        member = next(n for n in wheel.namelist() if n.startswith("ferrox/_native"))
        target = folder / "python" / "ferrox" / Path(member).name
        target.write_bytes(wheel.read(member))
    return folder / "python"


def remove_baseline(folder: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT)


def current_commit() -> str:
    """HEAD's short hash, with "+changes" when tracked code (the package,
    the Rust crates, the benchmarks) differs from it: the figures then come
    from code no commit holds."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    code = ["python", "rust", "benches"]
    changed = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", *code], capture_output=True)
    return head.stdout.strip() + ("+changes" if changed.returncode == 1 else "")


def run_child(script: str, python_path: Path, argv: list[str], env: dict[str, str | None]) -> Any:
    """`script argv` in a fresh interpreter that imports ferrox from
    `python_path`, with `env` on top of this one's (None: unset); returns
    the JSON its last line of output holds."""
    full = {k: v for k, v in os.environ.items() if env.get(k, v) is not None}
    full.update({k: v for k, v in env.items() if v is not None})
    full["PYTHONPATH"] = f"{python_path}{os.pathsep}{Path(script).resolve().parent}"
    out = subprocess.run([sys.executable, script, *argv], env=full, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the run with {python_path} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
