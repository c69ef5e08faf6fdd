"""The native CPU kernels run on as many threads as torch uses, whichever of
torch and ferrox a process imports first (layers/native.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = (
    "import sys\n"
    "if sys.argv[1] == 'torch-first':\n"
    "    import torch\n"
    "import ferrox, torch\n"
    "from ferrox.layers.native import kernel_threads\n"
    "torch.set_num_threads(int(sys.argv[2]))\n"
    "print(kernel_threads())"
)


@pytest.mark.parametrize(("order", "threads"), [("torch-first", 2), ("ferrox-first", 1)])
def test_kernel_threads_follow_torch(order: str, threads: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, order, str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(done.stdout) == threads
