"""One scheduler step through the Python bindings (schedule + update,
including the numpy arrays of the plan), as the engine calls it.

    python benches/scheduler_step.py [--num-running 256 1024] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ferrox._native import Scheduler


def build(num_running: int, seed: int = 0) -> Scheduler:
    rng = np.random.default_rng(seed)
    sched = Scheduler(
        block_size=16,
        num_blocks=num_running * (2048 + 2600) // 16 + 2048,
        max_num_seqs=num_running,
        max_num_batched_tokens=num_running + 16384,
        max_model_len=8192,
        vocab_size=49152,
    )
    for rid in range(num_running):
        prompt = rng.integers(0, 49152, size=int(rng.integers(512, 2049)), dtype=np.int64)
        sched.add_request(rid, prompt, max_tokens=100_000, ignore_eos=True)
    while True:
        plan = sched.schedule()
        sched.update(plan, np.full(plan.num_sampled, 7, dtype=np.int64))
        if plan.num_decodes == num_running:
            return sched


def time_steps(sched: Scheduler, steps: int) -> list[float]:
    times = []
    sampled_buf = np.full(4096, 7, dtype=np.int64)
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        # What the runner reads from the plan.
        _ = (plan.input_ids, plan.positions, plan.slot_mapping, plan.block_table)
        _ = (plan.query_start_loc, plan.seq_lens, plan.logits_indices)
        sched.update(plan, sampled_buf[: plan.num_sampled])
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", type=str, default=None, help="write results here")
    args = parser.parse_args()
    results = []
    print(f"{'running':>8} {'mean us':>9} {'p50 us':>9} {'p99 us':>9}")
    for n in args.num_running:
        sched = build(n)
        time_steps(sched, 50)  # warm up
        t = np.array(time_steps(sched, args.steps)) * 1e6
        row = {
            "num_running": n,
            "mean_us": float(t.mean()),
            "p50_us": float(np.percentile(t, 50)),
            "p99_us": float(np.percentile(t, 99)),
        }
        results.append(row)
        print(f"{n:>8} {row['mean_us']:>9.1f} {row['p50_us']:>9.1f} {row['p99_us']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
