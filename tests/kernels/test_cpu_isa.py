"""FERROX_CPU_ISA: a cap on the instruction sets of the CPU kernels (and of
torch's), checked at import."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = (
    "import os, ferrox\n"
    "from ferrox._native import cpu_isa, quant_matmul_kernel_cpu\n"
    "print(cpu_isa(), quant_matmul_kernel_cpu(), os.environ.get('ONEDNN_MAX_CPU_ISA'),"
    " os.environ.get('MKL_ENABLE_INSTRUCTIONS'))"
)
TORCH_CAPS = (
    "FERROX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "ATEN_CPU_CAPABILITY",
)


def probe(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCH_CAPS}
    if value is not None:
        env["FERROX_CPU_ISA"] = value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)


def has_avx_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx_vnni" in flags.split()


def test_a_cap_narrows_the_kernels_and_torchs() -> None:
    native = probe(None)
    assert native.returncode == 0, native.stderr
    widest, _, onednn, mkl = native.stdout.split()
    assert (onednn, mkl) == ("None", "None")  # uncapped: torch is left alone
    portable = probe("portable").stdout.split()
    assert portable == ["portable", "pairs", "SSE41", "SSE4_2"]
    if widest != "portable":  # a CPU with AVX2
        assert probe("AVX2").stdout.split() == ["avx2", "panels", "AVX2", "AVX2"]
        # AVX-VNNI where the CPU has it, else the AVX2 kernel
        vnni = ["avxvnni", "vnni_panels"] if has_avx_vnni() else ["avx2", "panels"]
        assert probe("avxvnni").stdout.split() == [*vnni, "AVX2_VNNI", "AVX2_E1"]
    # A cap above what the CPU has changes nothing.
    assert probe("amx").stdout.split()[:2] == native.stdout.split()[:2]
    if widest == "amx":  # AMX tiles: the avx512 cap turns them off, not the vector kernels
        assert probe("avx512").stdout.split() == ["avx512", "wide_panels", "None", "None"]
    else:
        assert probe("avx512").stdout.split()[:2] == native.stdout.split()[:2]


def test_an_unknown_level_is_refused_at_import() -> None:
    bad = probe("avx1024")
    assert bad.returncode != 0
    assert "FERROX_CPU_ISA='avx1024' names no instruction-set level" in bad.stderr
