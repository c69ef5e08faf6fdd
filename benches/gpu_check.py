"""Helpers of benches/gpu_check.sh.

preflight   what the machine has (GPU, driver, CUDA, torch, triton,
            transformers, a C compiler and Python headers for Triton's
            launcher, glibc, whether pip may install into this Python), the
            installed ferrox and its dependencies, and one trivial Triton
            kernel. Prints a table, writes it as JSON, and exits 1 when
            something the run needs is missing.
summary     one short table from a results folder: the phases with their
            exit codes and times, the tests passed / failed / skipped per
            phase (and the failures' names), and the benchmark figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import packaging.requirements
import packaging.tags
import packaging.utils


@dataclass
class Check:
    name: str
    value: str
    ok: bool
    needed: bool  # a failed needed check stops the run
    seconds: float = 0.0


def _run_check(name: str, needed: bool, probe: Callable[[], tuple[str, bool]]) -> Check:
    start = time.perf_counter()
    try:
        value, ok = probe()
    except Exception as exc:  # report any failure as the check's value
        value, ok = f"{type(exc).__name__}: {exc}".splitlines()[0][:160], False
    return Check(name, value, ok, needed, time.perf_counter() - start)


def _gpu() -> tuple[str, bool]:
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi", False
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    line = (done.stdout or done.stderr).strip().splitlines()
    return (line[0] if line else f"nvidia-smi exited {done.returncode}"), done.returncode == 0


def _torch() -> tuple[str, bool]:
    import torch

    cuda = torch.version.cuda or "none"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__}, CUDA {cuda}, no usable GPU", False
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    return f"torch {torch.__version__}, CUDA {cuda}, {name} (sm_{cap[0]}{cap[1]})", True


def _version(module: str) -> Callable[[], tuple[str, bool]]:
    def probe() -> tuple[str, bool]:
        mod = __import__(module)
        return f"{module} {getattr(mod, '__version__', '?')}", True

    return probe


def _compiler() -> tuple[str, bool]:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10)
            return f"{cc}: {done.stdout.splitlines()[0] if done.stdout else '?'}", True
    return "no C compiler (Triton builds its launcher with one)", False


def _python_headers() -> tuple[str, bool]:
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return str(header), header.is_file()


def _glibc() -> tuple[str, bool]:
    name, version = platform.libc_ver()
    return f"{name} {version} on {platform.machine()}", bool(version)


def _pip_target() -> tuple[str, bool]:
    managed = Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED"
    where = "externally managed: installs go to a --target folder" if managed.exists() else "yes"
    return f"pip may install into this Python: {where}", True


def _wheel_tags(wheels: Path) -> tuple[str, bool]:
    supported = set(packaging.tags.sys_tags())
    fits, misfits = [], []
    for wheel in sorted(wheels.glob("*.whl")):
        name, _, _, tags = packaging.utils.parse_wheel_filename(wheel.name)
        (fits if tags & supported else misfits).append(str(name))
    ferrox_fits = "ferrox" in fits
    text = f"{len(fits)} fit" + (f"; not: {', '.join(misfits)}" if misfits else "")
    return text, ferrox_fits


def _ferrox(site: Path) -> Callable[[], tuple[str, bool]]:
    def probe() -> tuple[str, bool]:
        import ferrox
        import ferrox._native
        import ferrox.engine.core
        import ferrox.server.app

        where = Path(ferrox.__file__).resolve().parent
        installed = where.is_relative_to(site.resolve())
        return f"ferrox {ferrox.__version__} from {where}", installed

    return probe


def _requirements() -> tuple[str, bool]:
    """ferrox's runtime requirements: installed, in range, and importable
    (which also catches a requirement's own missing dependency)."""
    import importlib
    import importlib.metadata

    modules: dict[str, list[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            modules.setdefault(packaging.utils.canonicalize_name(dist), []).append(module)
    missing = []
    for text in importlib.metadata.requires("ferrox") or []:
        req = packaging.requirements.Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(req.name)
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{req.name} {version} (needs {req.specifier})")
            continue
        for module in modules.get(packaging.utils.canonicalize_name(req.name), []):
            if module.startswith("_") or not module.isidentifier():
                continue
            try:
                importlib.import_module(module)
            except Exception as exc:
                missing.append(f"{req.name} (import {module}: {type(exc).__name__}: {exc})")
                break
    return ("all present" if not missing else "missing: " + "; ".join(missing)), not missing


def _triton_kernel(dry_run: bool) -> Callable[[], tuple[str, bool]]:
    def probe() -> tuple[str, bool]:
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

        device = "cpu" if dry_run else "cuda"
        x = torch.arange(1000, dtype=torch.float32, device=device)
        add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
        ok = bool((x.cpu() == torch.arange(1, 1001, dtype=torch.float32)).all())
        mode = "interpreted on the CPU" if dry_run else "compiled and run on the GPU"
        return f"add-one kernel {mode}: {'right' if ok else 'WRONG'}", ok

    return probe


def preflight(args: argparse.Namespace) -> int:
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    gpu = not args.dry_run
    checks = [
        _run_check("python", True, lambda: (f"{sys.version.split()[0]} {sys.executable}", True)),
        _run_check("glibc", False, _glibc),
        _run_check("pip", False, _pip_target),
        _run_check("wheels", True, lambda: _wheel_tags(Path(args.wheels))),
        _run_check("nvidia-smi", gpu, _gpu),
        _run_check("torch", True, _torch) if gpu else _run_check("torch", True, _version("torch")),
        _run_check("triton", True, _version("triton")),
        _run_check("transformers", True, _version("transformers")),
        _run_check("C compiler", gpu, _compiler),
        _run_check("Python headers", gpu, _python_headers),
        _run_check("ferrox", True, _ferrox(Path(args.site))),
        _run_check("dependencies", True, _requirements),
    ]
    checks.append(_run_check("triton kernel", True, _triton_kernel(args.dry_run)))
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok" if c.ok else ("MISSING" if c.needed else "absent")
        print(f"{c.name:<{width}}  {mark:<7}  {c.value}  ({c.seconds:.1f} s)")
    failed = [c.name for c in checks if c.needed and not c.ok]
    result = {"ok": not failed, "failed": failed, "checks": [asdict(c) for c in checks]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if failed:
        print(f"preflight: the run needs {', '.join(failed)}")
    return 1 if failed else 0


def _junit(path: Path) -> str:
    if not path.exists():
        return "no report"
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "empty report"
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    text = (
        f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped in {float(suite.get('time', 0)):.0f} s"
    )
    bad = [
        case.get("name", "?")
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return text + (f"; failed: {', '.join(bad[:6])}" if bad else "")


def _bench_lines(path: Path) -> list[str]:
    if not path.exists():
        return ["bench: no results"]
    bench = json.loads(path.read_text())
    lines = [f"bench: {bench.get('device', '?')}, torch {bench.get('torch', '?')}"]
    a = bench.get("a")
    if a:
        lines.append(
            f"  (a) batch-1 decode {a['decode_step_ms']:.2f} ms, floor {a['floor_ms']:.2f} ms "
            f"-> {a['fraction_of_floor_speed']:.0%} of floor speed (target {a['target']:.0%})"
        )
    for key, c in (bench.get("c") or {}).items():
        if not isinstance(c, dict):
            continue
        lines.append(
            f"  (c) {key}: graphs {c['graphs_ms']:.2f} ms, eager {c['eager_ms']:.2f} ms "
            f"({c['speedup']:.2f}x)"
        )
    for key, d in (bench.get("d") or {}).items():
        if isinstance(d, dict):
            lines.append(
                f"  (d) {key}: dequant-GEMM {d['triton_ms']:.3f} ms, bf16 {d['bf16_ms']:.3f} ms "
                f"({d['speedup']:.2f}x)"
            )
    b = bench.get("b") or {}
    if "ferrox_tok_s" in b:
        lines.append(f"  (b) ferrox {b['ferrox_tok_s']:.0f} output tok/s")
    if "ratio" in b:
        lines.append(
            f"  (b) transformers ({b['transformers_attention']}) {b['transformers_tok_s']:.0f} "
            f"tok/s -> {b['ratio']:.1f}x (target {b['target']:.0f}x)"
        )
    if bench.get("error"):
        lines.append(f"  error: {bench['error'].strip().splitlines()[-1]}")
    return lines


def summary(args: argparse.Namespace) -> int:
    out = Path(args.folder)
    lines = ["phase               rc       seconds  limit"]
    phases = out / "phases.tsv"
    if phases.exists():
        for row in phases.read_text().splitlines()[1:]:
            name, rc, seconds, limit = row.split("\t")
            rc_text = "TIMEOUT" if rc in ("124", "137") else rc
            lines.append(f"{name:<19} {rc_text:<8} {seconds:>7}  {limit}")
    preflight_file = out / "preflight.json"
    if preflight_file.exists():
        pre = json.loads(preflight_file.read_text())
        lines.append("preflight: " + ("ok" if pre["ok"] else "needs " + ", ".join(pre["failed"])))
    for name in ("kernels-full", "gpu", "kernels-small"):
        lines.append(f"tests {name}: {_junit(out / f'junit-{name}.xml')}")
    lines += _bench_lines(out / "bench.json")
    text = "\n".join(lines)
    print(text)
    (out / "summary.txt").write_text(text + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preflight")
    pre.add_argument("--wheels", required=True, help="the folder of wheels that was installed")
    pre.add_argument("--site", required=True, help="the folder the wheels were installed into")
    pre.add_argument("--json", default=None)
    pre.add_argument("--dry-run", action="store_true", help="no GPU: interpret the kernel")
    summ = sub.add_parser("summary")
    summ.add_argument("folder")
    args = parser.parse_args()
    return preflight(args) if args.command == "preflight" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
