"""When the native CPU kernels apply, and with how many threads."""

import torch

import ferrox


def on_cpu_fp32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def kernel_threads() -> int:
    # With OpenMP's workers still spinning after each torch op, extra kernel
    # threads would fight them for the cores: use one thread then.
    return torch.get_num_threads() if ferrox.OPENMP_SPIN_LIMITED else 1
