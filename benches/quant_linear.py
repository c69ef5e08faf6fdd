"""Block-format linear layers on the CPU (`ferrox.layers.quant_linear`): the
integer kernel against dequantize-then-float-GEMM, and the float32 layer
ferrox would run without blocks (oneDNN-packed), at the bundled model's
shapes, for 1 to 128 rows. Where the kernel stops winning is
`DEQUANTIZE_ABOVE_ROWS`.

    python benches/quant_linear.py [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ferrox  # noqa: F401  # isort: skip  (before torch: ferrox tunes OpenMP)
import numpy as np
import torch
from torch import nn

from ferrox.layers import quant_linear
from ferrox.layers.cpu_linear import PackedLinear
from ferrox.layers.quant_linear import QuantLinear

from cpu_linear import time_call  # isort: skip
from machine import write_record  # isort: skip

# SmolLM2-135M's layers in its GGUF formats (the LM head is the Q8_0 embedding).
SHAPES = {
    "qkv 576->960 q4_1": (576, 960, "q4_1"),
    "o 576->576 q4_1": (576, 576, "q4_1"),
    "gate_up 576->3072 q4_1": (576, 3072, "q4_1"),
    "down 1536->576 q4_1": (1536, 576, "q4_1"),
    "lm_head 576->49152 q8_0": (576, 49152, "q8_0"),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", default=None, help="only the layers whose name holds this")
    parser.add_argument(
        "--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    threshold = quant_linear.DEQUANTIZE_ABOVE_ROWS
    result: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'layer':24} {'rows':>4} {'kernel us':>10} {'dequant+GEMM us':>16} {'fp32 us':>8}")
    with torch.inference_mode():
        for name, (k, n, fmt) in SHAPES.items():
            if args.only and args.only not in name:
                continue
            dense = nn.Linear(k, n, bias=False)
            layer = QuantLinear.from_linear(dense, fmt)
            packed = PackedLinear(dense)
            for m in [int(v) for v in args.rows.split(",")]:
                x = torch.randn(m, k)
                timings: dict[str, list[float]] = {"kernel": [], "dequant": [], "fp32": []}
                for _ in range(args.repeats):
                    quant_linear.DEQUANTIZE_ABOVE_ROWS = 1 << 30  # always the kernel
                    timings["kernel"].append(time_call(layer, x))
                    quant_linear.DEQUANTIZE_ABOVE_ROWS = 0  # always dequantize (if it fits)
                    timings["dequant"].append(time_call(layer, x))
                    timings["fp32"].append(time_call(packed, x))
                quant_linear.DEQUANTIZE_ABOVE_ROWS = threshold
                row = {key: float(np.median(v)) * 1e6 for key, v in timings.items()}
                result.setdefault(name, {})[str(m)] = row
                print(
                    f"{name:24} {m:4d} {row['kernel']:10.0f} {row['dequant']:16.0f} "
                    f"{row['fp32']:8.0f}"
                )
    print(f"\nDEQUANTIZE_ABOVE_ROWS = {threshold}")
    if args.json:
        write_record(args.json, microseconds=result)


if __name__ == "__main__":
    main()
