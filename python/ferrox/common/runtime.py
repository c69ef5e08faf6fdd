"""Facts of this process fixed when ferrox is first imported (no torch).

`ferrox/__init__.py` imports this module before anything else, so the
OpenMP setting below is in place before any ferrox module imports torch.
"""

import ctypes
import gc
import os
import platform

from ferrox.common.errors import InvalidArgumentError

__version__ = "0.1.0"

# glibc's malloc serves each allocation above a threshold (at most 32 MiB) by
# mapping fresh pages and unmaps them on free, and gives the heap's free top
# back to the system past another: a step's large temporaries (a prefill
# chunk's activations are tens to hundreds of MiB) are then faulted in and
# zeroed by the kernel, page by page, at every step. Raised to KEEP_FREED,
# freed memory stays in the heap for the next step (as tcmalloc or jemalloc
# would keep it). A process that sets malloc's own knobs keeps them.
KEEP_FREED = 1 << 30
# The environment variables by which a process sets malloc's knobs itself.
MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LIBC = ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


def _keep_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds; False where it did not."""
    if _LIBC is None or any(k in os.environ for k in MALLOC_SETTINGS):
        return False
    mallopt = _LIBC.mallopt
    return all(mallopt(knob, KEEP_FREED) == 1 for knob in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD))


FREED_MEMORY_KEPT = _keep_freed_memory()


def release_freed_memory() -> None:
    """Gives the heap's free memory back to the system (`malloc_trim`), for
    the end of loading: its temporaries are not a step's, and the raised
    thresholds would otherwise keep them resident for good."""
    if _LIBC is not None and FREED_MEMORY_KEPT:
        _LIBC.malloc_trim(0)


def freeze_long_lived_objects() -> None:
    """Takes every object alive now out of the cyclic garbage collector's
    scans (`gc.freeze`), for a process that will serve one engine until it
    ends: the model's modules, the tokenizer's vocabulary and the libraries'
    own objects (400,000 on the bundled model) would otherwise be walked by
    every full collection, a pause of a tenth of a second or more in the
    engine loop whenever enough objects outlive the younger generations.
    Reference counting still frees them; only their cycles wait for
    `thaw_long_lived_objects`."""
    gc.collect()
    gc.freeze()


def thaw_long_lived_objects() -> None:
    """Gives the frozen objects back to the collector (before the process
    ends, so that its last collection can free their cycles)."""
    gc.unfreeze()


# GNU OpenMP workers otherwise spin for a long while after each torch op and
# take the cores from the native kernels that run between ops. It only takes
# effect when ferrox is imported before torch; an explicit setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

# FERROX_CPU_ISA caps the instruction sets of ferrox's CPU kernels (read by
# `ferrox_cpu::isa`) and, unless they are set, of torch's own: its vectorised
# ops (ATEN_CPU_CAPABILITY), oneDNN's GEMMs (ONEDNN_MAX_CPU_ISA) and MKL's,
# which run a float32 `F.linear` (MKL_ENABLE_INSTRUCTIONS), so that a machine
# with AVX-512 runs every kernel as one without it would (a transformers or
# float32 peer measured in the same process included). Like the OpenMP
# setting, torch's part only holds when ferrox is imported first.
_ISA_CAPS: dict[str, tuple[str, str, str] | None] = {
    "portable": ("default", "SSE41", "SSE4_2"),
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avxvnni": ("avx2", "AVX2_VNNI", "AVX2_E1"),
    "avx512": None,
    "amx": None,
    "native": None,
}
CPU_ISA = os.environ.get("FERROX_CPU_ISA", "native").strip().lower() or "native"
if CPU_ISA not in _ISA_CAPS:
    raise InvalidArgumentError(
        f"FERROX_CPU_ISA={os.environ['FERROX_CPU_ISA']!r} names no instruction-set level; "
        f"expected one of {', '.join(sorted(_ISA_CAPS))}"
    )
_torch_caps = _ISA_CAPS[CPU_ISA]
if _torch_caps is not None:
    os.environ.setdefault("ATEN_CPU_CAPABILITY", _torch_caps[0])
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _torch_caps[1])
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", _torch_caps[2])
