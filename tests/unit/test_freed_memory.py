"""Importing ferrox keeps freed memory in glibc's heap (common/runtime.py):
a large temporary allocated again is not faulted in page by page."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from ferrox.common.runtime import MALLOC_SETTINGS

PROBE = (
    "import resource, ferrox, numpy as np\n"
    "from ferrox.common import runtime\n"
    "def temporary():\n"
    "    a = np.ones(100 * 2**20 // 8)\n"  # 100 MiB, as a prefill chunk's activations
    "    del a\n"
    "temporary()\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "temporary()\n"
    "print(runtime.FREED_MEMORY_KEPT, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)"
)

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)


def run(script: str, **extra: str) -> str:
    """`script`'s output, run without the process's own malloc settings."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_SETTINGS} | extra
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout


def probe(**extra: str) -> tuple[bool, int]:
    kept, faults = run(PROBE, **extra).split()
    return kept == "True", int(faults)


def test_a_freed_temporary_is_reused_without_page_faults() -> None:
    kept, faults = probe()
    assert kept
    # Unmapped and mapped again, 100 MiB is 25,600 faults of 4 KiB pages (50
    # or more with transparent huge pages, each zeroing 2 MiB); from the heap,
    # none but the allocator's own.
    assert faults < 30


def test_malloc_settings_of_the_process_are_left_alone() -> None:
    kept, faults = probe(MALLOC_TRIM_THRESHOLD_=str(128 * 1024))
    assert not kept
    assert faults >= 30  # glibc's own thresholds: the temporary is mapped afresh


RELEASE = (
    "import ferrox, numpy as np\n"
    "from ferrox.common.runtime import release_freed_memory\n"
    "def rss():\n"
    "    return int(open('/proc/self/statm').read().split()[1]) * 4096 // 2**20\n"
    "a = np.ones(200 * 2**20 // 8)\n"
    "del a\n"
    "kept = rss()\n"
    "release_freed_memory()\n"
    "print(kept - rss())"
)


def test_loading_gives_its_freed_memory_back() -> None:
    """The runner calls `release_freed_memory` once the model is loaded: the
    freed 200 MiB, kept resident until then, go back to the system."""
    assert int(run(RELEASE)) >= 150
