"""The same workload through `ferrox serve` (streaming completions, all
requests at once) and through `LLM.generate` in-process.

    python benches/server_vs_offline.py [--num-requests 64] [--output-len 64]

Prints output tokens/s of both and their ratio; the p50 inter-token latency
seen by the streaming clients against the p50 decode step of the offline
engine on the same batch; and the frontend's own CPU time per streamed token
(decode the engine's message, detokenize, match stop strings, encode SSE).
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
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
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


def served(prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(output tokens/s, p50 inter-token latency seconds)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrox", "serve", "--port", str(port),
         "--max-num-seqs", str(len(prompts)), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
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
                await _stream_one(client, base + "/v1/completions", prompts[0], 2)  # warm up
                start = time.perf_counter()
                results = await asyncio.gather(
                    *(_stream_one(client, base + "/v1/completions", p, output_len) for p in prompts)
                )
                return time.perf_counter() - start, results

        elapsed, token_times = asyncio.run(run())
        # Gaps between tokens after the first (the first gap is the TTFT).
        gaps = [b - a for times in token_times for a, b in itertools.pairwise(times[1:])]
        return len(prompts) * output_len / elapsed, float(np.median(gaps))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def frontend_cost_per_token(num_streams: int = 64, steps: int = 64) -> float:
    """CPU seconds the frontend spends per streamed token: decoding the
    engine's msgpack step message, detokenizing, matching stop strings and
    encoding the SSE chunk (measured in-process, without the engine)."""
    import msgspec

    from ferrox.config import EngineConfig
    from ferrox.engine import protocol as p
    from ferrox.engine.output_processor import SequenceOutput
    from ferrox.loader.model_loader import load_tokenizer
    from ferrox.server import openai_protocol as op

    tok = load_tokenizer(EngineConfig.create())
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=steps, stop=["never appears here"])
    seqs = [
        SequenceOutput(0, tok, rng.integers(100, 49000, 32).tolist(), params)
        for _ in range(num_streams)
    ]
    messages = [
        p.encoder.encode(
            p.StepOutputs(
                [
                    p.SequenceDelta(f"r{i}", 0, [int(rng.integers(100, 49000))])
                    for i in range(num_streams)
                ],
                [], [], p.EngineStats(),
            )
        )
        for _ in range(steps)
    ]  # fmt: skip
    start = time.process_time()
    for raw in messages:
        msg = p.output_decoder.decode(raw)
        for delta, seq in zip(msg.deltas, seqs, strict=True):
            upd = seq.apply(delta)
            choice = op.CompletionChoice(index=0, text=upd.text, finish_reason=upd.finish_reason)
            msgspec.json.encode(op.CompletionStreamResponse(id="x", model="m", choices=[choice]))
    return (time.process_time() - start) / (num_streams * steps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    prompts = workload(args.num_requests, args.seed)
    off_rate, step = offline(prompts, args.output_len)
    print(
        f"offline LLM.generate: {off_rate:8.1f} tok/s, p50 decode step {step * 1e3:.1f} ms",
        flush=True,
    )
    srv_rate, itl = served(prompts, args.output_len)
    print(
        f"server (streaming):   {srv_rate:8.1f} tok/s, p50 inter-token latency {itl * 1e3:.1f} ms"
    )
    added = (itl - step) * 1e3
    cost = frontend_cost_per_token()
    print(f"server / offline = {srv_rate / off_rate:.2f}; p50 ITL - p50 step = {added:.2f} ms")
    print(f"frontend CPU per streamed token: {cost * 1e6:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"offline_tok_s": off_rate, "server_tok_s": srv_rate, "ratio": srv_rate / off_rate,
                 "offline_step_p50_s": step, "server_itl_p50_s": itl,
                 "frontend_cpu_per_token_s": cost, "cpus": os.cpu_count()},
                f, indent=2,
            )  # fmt: skip


if __name__ == "__main__":
    main()
