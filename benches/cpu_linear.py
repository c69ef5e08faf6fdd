"""CPU linear layers: `F.linear` against the oneDNN-packed weights ferrox
uses (`ferrox.layers.cpu_linear`), at the bundled model's shapes, for the row
counts of a decode (1), speculative verifications (2-17) and small batches.

    python benches/cpu_linear.py [--repeats 5] [--json FILE]
    python benches/cpu_linear.py --small [--repeats 5]

Prints microseconds per call (median of repeats, min-max) and the ratio.
`--small` uses the shapes of a tiny model (hidden 64, the one
`benches/host_overhead.py` runs) and row counts up to a 256-sequence batch,
where `PackedLinear` sends small products to `F.linear`; "packed" is then
oneDNN's op alone, and a third column is `PackedLinear` as it runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import ferrox  # noqa: F401  # isort: skip  (before torch: ferrox tunes OpenMP)
import numpy as np
import torch
from torch import nn

from ferrox.layers.cpu_linear import PackedLinear, packed_linear_supported

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down, LM head.
SHAPES = {
    "qkv 576->960": (576, 960),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (576, 3072),
    "down 1536->576": (1536, 576),
    "lm_head 576->49152": (576, 49152),
}
ROWS = (1, 2, 4, 7, 8, 17)
# The tiny Llama of benches/host_overhead.py (hidden 64, 4 heads of 16, 2 KV
# heads, intermediate 128, vocabulary 1,000).
SMALL_SHAPES = {
    "qkv 64->128": (64, 128),
    "o 64->64": (64, 64),
    "gate_up 64->256": (64, 256),
    "down 128->64": (128, 64),
    "lm_head 64->1000": (64, 1000),
}
SMALL_ROWS = (1, 4, 64, 256)


def time_call(fn, x: torch.Tensor, seconds: float = 0.2) -> float:
    fn(x)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn(x)
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--small", action="store_true", help="a tiny model's shapes")
    args = parser.parse_args()
    shapes, row_counts = (SMALL_SHAPES, SMALL_ROWS) if args.small else (SHAPES, ROWS)
    if not packed_linear_supported():
        raise SystemExit("this torch build has no oneDNN linear ops")
    torch.manual_seed(0)
    result: dict[str, dict[str, dict[str, float]]] = {}
    header = f"{'layer':20} {'rows':>4} {'F.linear us':>12} {'packed us':>10} {'ratio':>6}"
    print(header + ("              PackedLinear us" if args.small else ""))
    with torch.inference_mode():
        for name, (k, n) in shapes.items():
            linear = nn.Linear(k, n, bias=False)
            layer = PackedLinear(linear)
            onednn = PackedLinear(linear)
            onednn.plain_rows = 0  # oneDNN's op whatever the rows
            for m in row_counts:
                x = torch.randn(m, k)
                assert torch.allclose(linear(x), onednn(x), rtol=1e-4, atol=1e-4)
                assert torch.allclose(linear(x), layer(x), rtol=1e-4, atol=1e-4)
                plain, fast, chosen = [], [], []
                for _ in range(args.repeats):
                    plain.append(time_call(linear, x))
                    fast.append(time_call(onednn, x))
                    if args.small:
                        chosen.append(time_call(layer, x))
                ratios = [p / f for p, f in zip(plain, fast, strict=True)]
                row = {
                    "linear_us": float(np.median(plain)) * 1e6,
                    "packed_us": float(np.median(fast)) * 1e6,
                    "ratio": float(np.median(ratios)),
                    "ratio_min": float(np.min(ratios)),
                    "ratio_max": float(np.max(ratios)),
                }
                line = (
                    f"{name:20} {m:4d} {row['linear_us']:12.0f} {row['packed_us']:10.0f} "
                    f"{row['ratio']:5.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
                )
                if args.small:
                    row["packed_linear_us"] = float(np.median(chosen)) * 1e6
                    line += f" {row['packed_linear_us']:14.0f}"
                result.setdefault(name, {})[str(m)] = row
                print(line)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
