"""The same workload through `ferrox serve` (streaming completions, all
requests at once) and through `LLM.generate` in-process.

    python benches/server_vs_offline.py [--num-requests 64] [--output-len 64] [--repeats 5]

Prints output tokens/s of both and their ratio; the p50 inter-token latency
seen by the streaming clients against the p50 decode step of the offline
engine on the same batch; the p50 of the server's own
`ferrox:frontend_token_latency_seconds` (from the engine sending a step to
the frontend writing the token's SSE event); and the frontend process's CPU
time per streamed token (decode the engine's message, detokenize, match stop
strings, encode and write the SSE event).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from ferrox import LLM, SamplingParams


def workload(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 49000, size=int(rng.integers(32, 257))).tolist() for _ in range(n)]


def offline(prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(output tokens/s, p50 decode step seconds)."""
    llm = LLM(max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    engine, processor = llm.engine, llm.output_processor
    for i, p in enumerate(prompts):
        processor.add_request(f"r{i}", None, p, params)
        engine.add_request(f"r{i}", p, params)
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        processor.process(*engine.step())  # the engine step and its detokenization
        steps.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    decode_steps = steps[-(output_len - 2) :]  # the steady decode phase
    return len(prompts) * output_len / elapsed, float(np.median(decode_steps))


async def _stream_one(client, url: str, prompt: list[int], output_len: int) -> list[float]:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


def histogram_quantile(metrics_text: str, name: str, q: float) -> float:
    """The q-quantile of a Prometheus histogram, interpolated within its
    bucket the way Prometheus' histogram_quantile does."""
    buckets = []
    for line in metrics_text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1]
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_le
            return lower_le + (le - lower_le) * (rank - lower_count) / max(count - lower_count, 1)
        lower_le, lower_count = le, count
    return lower_le


def served(prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Streams every prompt through a fresh `ferrox serve` at once."""
    import httpx
    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrox", "serve", "--port", str(port),
         "--max-num-seqs", str(len(prompts)), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/completions"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)

        async def run() -> tuple[float, list[list[float]]]:
            limits = httpx.Limits(max_connections=len(prompts) + 8)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                await _stream_one(client, url, prompts[0], 2)  # warm up
                start = time.perf_counter()
                results = await asyncio.gather(
                    *(_stream_one(client, url, p, output_len) for p in prompts)
                )
                return time.perf_counter() - start, results

        # The frontend is the server's main process; the engine core is its child.
        frontend = psutil.Process(proc.pid)
        client_cpu, frontend_cpu = time.process_time(), sum(frontend.cpu_times()[:2])
        elapsed, token_times = asyncio.run(run())
        client_cpu = time.process_time() - client_cpu
        frontend_cpu = sum(frontend.cpu_times()[:2]) - frontend_cpu
        # Gaps between tokens after the first (the first gap is the TTFT).
        gaps = [b - a for times in token_times for a, b in itertools.pairwise(times[1:])]
        metrics = httpx.get(base + "/metrics", timeout=10).text
        tokens = len(prompts) * output_len
        return {
            "tok_s": tokens / elapsed,
            "seconds": elapsed,
            "itl_p50_s": float(np.median(gaps)),
            "frontend_latency_p50_s": histogram_quantile(
                metrics, "ferrox:frontend_token_latency_seconds", 0.5
            ),
            "frontend_cpu_per_token_s": frontend_cpu / tokens,
            "client_cpu_s": client_cpu,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the pair this many times (a fresh workload seed each time) and report "
        "medians; a small machine's run-to-run noise is larger than the gap",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs = []
    for r in range(args.repeats):
        prompts = workload(args.num_requests, args.seed + r)
        off_rate, step = offline(prompts, args.output_len)
        srv = served(prompts, args.output_len)
        run = {
            "offline_tok_s": off_rate,
            "offline_step_p50_s": step,
            **{f"server_{k}": v for k, v in srv.items()},
            "ratio": srv["tok_s"] / off_rate,
        }
        runs.append(run)
        print(
            f"[{r + 1}/{args.repeats}] offline {off_rate:6.1f} tok/s, decode step p50 "
            f"{step * 1e3:.1f} ms | server {srv['tok_s']:6.1f} tok/s, ITL p50 "
            f"{srv['itl_p50_s'] * 1e3:.1f} ms, frontend latency p50 "
            f"{srv['frontend_latency_p50_s'] * 1e3:.2f} ms, frontend CPU "
            f"{srv['frontend_cpu_per_token_s'] * 1e6:.0f} us/token, clients' CPU "
            f"{srv['client_cpu_s']:.2f} s of {srv['seconds']:.1f} s | ratio {run['ratio']:.2f}",
            flush=True,
        )

    def median(key: str) -> float:
        return float(np.median([run[key] for run in runs]))

    summary = {
        "ratio": median("ratio"),
        "itl_minus_step_s": float(
            np.median([run["server_itl_p50_s"] - run["offline_step_p50_s"] for run in runs])
        ),
        "frontend_latency_p50_s": median("server_frontend_latency_p50_s"),
        "frontend_cpu_per_token_s": median("server_frontend_cpu_per_token_s"),
    }
    n = len(runs)
    print(f"server / offline output tok/s = {summary['ratio']:.2f} (median of {n})")
    print(f"client ITL p50 - offline decode step p50 = {summary['itl_minus_step_s'] * 1e3:.2f} ms")
    print(
        "frontend latency per token, p50 (engine sent the step -> SSE event written): "
        f"{summary['frontend_latency_p50_s'] * 1e3:.2f} ms"
    )
    print(
        "frontend process CPU per streamed token (HTTP included): "
        f"{summary['frontend_cpu_per_token_s'] * 1e6:.0f} us"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"num_requests": args.num_requests, "output_len": args.output_len,
                 "cpus": os.cpu_count(), "median": summary, "runs": runs},
                f, indent=2,
            )  # fmt: skip


if __name__ == "__main__":
    main()
