"""benches/gpu_check.sh on a machine without a GPU: `--dry-run` installs a
freshly built wheel into a folder of its own, runs the preflight, the test
phases (the GPU tests skip themselves) and a tiny-model benchmark on the CPU,
and writes every result file; without wheels it stops with a clear message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benches" / "gpu_check.sh"


def run_script(
    *args: str, out: Path, timeout: float = 300, budget_s: int | None = None
) -> subprocess.CompletedProcess[str]:
    # The scripts call `python3`: make it this interpreter.
    env = {
        **os.environ,
        "OUT": str(out),
        "FERROX_GPU_BUDGET_S": str(budget_s) if budget_s is not None else "570",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project built as a wheel, as benches/gpu_prepare.sh builds it
    (without the old-glibc linker, which only changes the platform tag)."""
    out = tmp_path_factory.mktemp("wheels")
    done = subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(out.glob("ferrox-*.whl"))) == 1
    return out


def junit_counts(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def test_dry_run_installs_checks_and_writes_every_result(wheel_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_script("--dry-run", str(wheel_dir), out=out)
    log = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, log

    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["ok"], preflight
    checks = {c["name"]: c for c in preflight["checks"]}
    # ferrox was imported from the wheel just installed, not from the source tree.
    assert "ferrox-gpu-check" in checks["ferrox"]["value"], checks["ferrox"]
    assert checks["triton kernel"]["ok"] and "right" in checks["triton kernel"]["value"]
    assert not checks["nvidia-smi"]["needed"]

    # The GPU test phases ran pytest (their tests skip without a GPU) and
    # wrote junit reports; the small kernel cases were collected.
    full = junit_counts(out / "junit-kernels-full.xml")
    gpu = junit_counts(out / "junit-gpu.xml")
    assert full["tests"] > 0 and full["skipped"] == full["tests"], full
    assert gpu["tests"] > 0 and gpu["skipped"] == gpu["tests"], gpu
    assert "tests collected" in (out / "pytest-kernels-small.log").read_text()

    bench = json.loads((out / "bench.json").read_text())
    assert "error" not in bench, bench["error"]
    assert bench["a"]["decode_step_ms"] > 0
    assert {"batch_1", "batch_64"} <= set(bench["c"])
    assert bench["b"]["ferrox_tok_s"] > 0 and bench["b"]["transformers_tok_s"] > 0

    phases = [row.split("\t") for row in (out / "phases.tsv").read_text().splitlines()[1:]]
    assert [p[0] for p in phases] == [
        "install", "preflight", "kernels-full-size", "gpu-engine", "bench", "kernels-small"
    ]  # fmt: skip
    assert all(p[1] == "0" for p in phases), phases
    summary = (out / "summary.txt").read_text()
    assert "preflight: ok" in summary and "(b) transformers (sdpa)" in summary


def test_a_missing_wheel_folder_stops_with_instructions(tmp_path: Path) -> None:
    done = run_script(str(tmp_path / "no-such-folder"), out=tmp_path / "out", timeout=60)
    assert done.returncode == 2
    assert "gpu_prepare.sh" in done.stderr and "ignored by git" in done.stderr


def test_a_time_budget_too_small_skips_phases_instead_of_overrunning(
    wheel_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = run_script("--dry-run", str(wheel_dir), out=out, timeout=120, budget_s=0)
    rows = [row.split("\t") for row in (out / "phases.tsv").read_text().splitlines()[1:]]
    assert rows and all(r[1] == "skipped" for r in rows), rows
    assert done.returncode == 1, done.stdout[-3000:]  # nothing ran: not a success
