"""When the native CPU kernels apply, and with how many threads."""

import numpy as np
import torch

from ferrox.common import runtime


def on_cpu_fp32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def kv_array(cache: torch.Tensor) -> np.ndarray:
    """A KV cache tensor as the native kernels take it: float32 as it is,
    float16 as its bits (int16; the bindings read no numpy float16)."""
    if cache.dtype == torch.float16:
        return cache.view(torch.int16).numpy()
    return cache.numpy()


def kernel_threads() -> int:
    # With OpenMP's workers still spinning after each torch op, extra kernel
    # threads would fight them for the cores: use one thread then.
    return torch.get_num_threads() if runtime.OPENMP_SPIN_LIMITED else 1
