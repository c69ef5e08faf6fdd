"""PNG plots of benchmark reports (matplotlib, from the `bench` extra, imported only
when plotting)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ferrox.bench import require_bench_extra


def plot_reports(reports: list[dict[str, Any]], out: Path, stem: str) -> list[Path]:
    matplotlib = require_bench_extra("matplotlib", "plotting benchmark reports")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for report in reports:
        ok = [i for i, error in enumerate(report["errors"]) if not error]
        series = {
            "TTFT (ms)": [report["ttfts"][i] * 1e3 for i in ok],
            "ITL (ms)": [g * 1e3 for i in ok for g in report["itls"][i]],
            "E2E latency (ms)": [report["e2els"][i] * 1e3 for i in ok],
        }
        for ax, (name, values) in zip(axes, series.items(), strict=True):
            if values:
                xs = np.sort(values)
                ax.plot(
                    xs, np.arange(1, len(xs) + 1) / len(xs), label=f"rate {report['request_rate']}"
                )
            ax.set_xlabel(name)
            ax.set_ylabel("fraction of requests" if "ITL" not in name else "fraction of tokens")
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{stem}: latency CDFs")
    fig.tight_layout()
    paths.append(out / f"{stem}-latency-cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if len(reports) > 1:
        finite = [r["request_rate"] for r in reports if not math.isinf(r["request_rate"])]
        top = (max(finite) if finite else 1.0) * 2
        rates = [top if math.isinf(r["request_rate"]) else r["request_rate"] for r in reports]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.plot(rates, [r["output_throughput"] for r in reports], marker="o")
        left.set_xlabel("request rate (req/s; rightmost = all at once)")
        left.set_ylabel("output tokens/s")
        right.plot(rates, [r["p99_ttft_ms"] for r in reports], marker="o", color="tab:red")
        right.set_xlabel("request rate (req/s; rightmost = all at once)")
        right.set_ylabel("p99 TTFT (ms)")
        for ax in (left, right):
            ax.grid(alpha=0.3)
        fig.suptitle(f"{stem}: request-rate sweep")
        fig.tight_layout()
        paths.append(out / f"{stem}-sweep.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
