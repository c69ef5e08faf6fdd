"""When the native CPU kernels apply, and with how many threads."""

import numpy as np
import torch


def on_cpu_fp32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def kv_array(cache: torch.Tensor) -> np.ndarray:
    """A KV cache tensor as the native kernels take it: float32 as it is,
    float16 as its bits (int16; the bindings read no numpy float16)."""
    if cache.dtype == torch.float16:
        return cache.view(torch.int16).numpy()
    return cache.numpy()


def state_array(states: torch.Tensor) -> np.ndarray:
    """A recurrent-state pool as the native kernels take it: float32 as it
    is, bfloat16 as its bits (int16; numpy has no bfloat16)."""
    if states.dtype == torch.bfloat16:
        return states.view(torch.int16).numpy()
    return states.numpy()


def kernel_threads() -> int:
    """As many threads as torch uses (its default, the user's setting, or a
    tensor-parallel rank's share of the cores); the kernels honour it. Also
    where torch was imported first and its OpenMP workers spin longer after
    each op (`runtime`): two threads still beat one there."""
    return torch.get_num_threads()
