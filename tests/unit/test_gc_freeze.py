"""The engine-core process takes the objects alive at start-up out of the
cyclic collector's scans (common/runtime.py), and gives them back before it
ends."""

from __future__ import annotations

import subprocess
import sys

PROBE = (
    "import gc\n"
    "from ferrox.common import runtime\n"
    "kept = [[i] for i in range(1000)]\n"
    "def scanned():\n"
    "    return any(o is kept for o in gc.get_objects())\n"
    "before = scanned()\n"
    "runtime.freeze_long_lived_objects()\n"
    "frozen, during = gc.get_freeze_count(), scanned()\n"
    "runtime.thaw_long_lived_objects()\n"
    "print(before, frozen >= 1000, during, gc.get_freeze_count(), scanned())"
)


def test_freeze_takes_live_objects_out_of_the_scans_and_thaw_gives_them_back() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True", "False", "0", "True"]
