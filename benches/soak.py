"""A soak of `ferrox serve`: minutes of mixed load with random client
disconnects, aborts and bad requests; then idle connections; then a stream's
responsiveness while a multi-megabyte prompt is tokenized.

    python benches/soak.py [--model PATH] [--duration 240] [--concurrency 12]
                           [--baseline REF] [--repeats 3] [--json FILE]

Prints requests served and errors by kind (an "unexpected" answer is a 5xx,
or any answer a well-formed request should not get), KV blocks still in use
once the server is idle (must be 0), the RSS of both processes after the
first minute and at the end, the TTFT p99 of streams started in the first
minute against the last; the RSS growth with `--idle-connections` open idle
connections; and the longest gap between a stream's tokens with and without
a concurrent multi-megabyte prompt, `--repeats` times, against the code at
git ref `--baseline` too when given (built in a temporary worktree). Default
model: the bundled one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "judge"]  # fmt: skip
BAD_BODIES: list[dict[str, Any]] = [
    {"prompt": "x", "max_tokens": 2**40},
    {"prompt": "x", "priority": 2**40},
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "top_k": 2**70},
    {"prompt": "x", "n": 10**6},
    {"prompt": [], "max_tokens": 4},
    {"prompt": [10**9]},
    {"prompt": "x", "logit_bias": {"abc": 1}},
    {"prompt": "x", "stop": ["s"] * 1000},
    {"prompt": "x", "stop_token_ids": [2**40]},
    {"prompt": {"not": "a prompt"}},
    {"prompt": "x", "logprobs": 10**6},
]


@dataclass
class Tally:
    served: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (start offset, ttft)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Server:
    def __init__(
        self, model: str | None, max_num_seqs: int, pythonpath: Path | None = None
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [sys.executable, "-m", "ferrox", "serve", "--port", str(port),
                "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]  # fmt: skip
        if model:
            args += ["--model", model]
        env = dict(os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {}))
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("the server exited while starting")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise SystemExit("the server did not start")
        children = psutil.Process(self.proc.pid).children()
        self.engine = next(c for c in children if "spawn_main" in " ".join(c.cmdline()))

    def rss_mb(self) -> tuple[float, float]:
        frontend = psutil.Process(self.proc.pid).memory_info().rss
        return frontend / 2**20, self.engine.memory_info().rss / 2**20

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("ferrox:") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0].removeprefix("ferrox:")] = float(value)
        return values

    def wait_idle(self, timeout: float = 120) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["num_requests_running"] + m["num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


async def one_request(
    client: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally, t0: float
) -> None:
    kind = rng.choices(
        ["stream", "plain", "chat", "n", "long", "disconnect", "abort", "bad"],
        weights=[30, 15, 15, 8, 5, 10, 7, 10],
    )[0]
    body: dict[str, Any] = {"prompt": text(rng, rng.randint(10, 80)), "max_tokens": 32}
    route = "/v1/completions"
    if kind == "chat":
        route = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": 32}
    elif kind == "n":
        body.update(n=3, temperature=0.8)
    elif kind == "long":
        body.update(prompt=text(rng, 1200), max_tokens=8)
    elif kind == "bad":
        body = dict(rng.choice(BAD_BODIES))
    stream = kind in ("stream", "chat", "long", "disconnect")
    body["stream"] = stream
    start = time.perf_counter()
    try:
        if kind == "abort":  # the client gives up mid-request
            with contextlib.suppress(httpx.TimeoutException):
                await client.post(url + route, json=body, timeout=rng.uniform(0.05, 0.5))
            tally.served[kind] += 1
            return
        if not stream:
            r = await client.post(url + route, json=body)
            expected = 400 if kind == "bad" else 200
            if r.status_code == expected:
                tally.served[kind] += 1
            else:
                tally.errors[f"{kind}: unexpected {r.status_code}"] += 1
            return
        async with client.stream("POST", url + route, json=body) as r:
            if r.status_code != 200:
                tally.errors[f"{kind}: unexpected {r.status_code}"] += 1
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if (chunks == 0 and kind != "chat") or (chunks == 1 and kind == "chat"):
                    tally.ttfts.append((start - t0, time.perf_counter() - start))
                chunks += 1
                if kind == "disconnect" and chunks >= 3:
                    break  # the client goes away mid-stream
                if '"error"' in line:
                    tally.errors[f"{kind}: error event"] += 1
                    return
            tally.served[kind] += 1
    except httpx.HTTPError as e:
        tally.errors[f"{kind}: {type(e).__name__}"] += 1


async def soak(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    t0 = time.perf_counter()
    end = t0 + args.duration
    rss_first: tuple[float, float] | None = None

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=300) as client:
            while time.perf_counter() < end:
                await one_request(client, server.url, rng, tally, t0)

    async def sample_rss() -> None:
        nonlocal rss_first
        await asyncio.sleep(min(60.0, args.duration / 4))
        rss_first = server.rss_mb()

    await asyncio.gather(sample_rss(), *(worker(i) for i in range(args.concurrency)))
    rss_end = server.rss_mb()
    idle = server.wait_idle()
    first_minute = min(60.0, args.duration / 4)
    early = [t for s, t in tally.ttfts if s < first_minute]
    late = [t for s, t in tally.ttfts if s > args.duration - first_minute]
    total_blocks = idle["kv_cache_total_blocks"]
    return {
        "duration_s": args.duration,
        "served": dict(tally.served),
        "errors": dict(tally.errors),
        "leaked_kv_blocks": idle["kv_cache_used_blocks"],
        "free_plus_cached_equals_total": idle["kv_cache_free_blocks"]
        + idle["kv_cache_cached_blocks"]
        == total_blocks,
        "rss_mb_after_first_minute": rss_first,
        "rss_mb_end": rss_end,
        "ttft_p99_first_minute_s": float(np.percentile(early, 99)) if early else None,
        "ttft_p99_last_minute_s": float(np.percentile(late, 99)) if late else None,
        "health_after": httpx.get(server.url + "/health").status_code,
    }


def idle_connections(server: Server, count: int, hold_s: float = 5.0) -> dict[str, Any]:
    """RSS growth with `count` connections open: half idle, half mid-request
    (headers sent, body never finished)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, count + 256), hard), hard))
    before = server.rss_mb()
    host, port = server.url.removeprefix("http://").split(":")
    socks = []
    for i in range(count):
        s = socket.create_connection((host, int(port)))
        if i % 2:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
        socks.append(s)
    time.sleep(hold_s)
    during = server.rss_mb()
    health = httpx.get(server.url + "/health", timeout=30).status_code
    for s in socks:
        s.close()
    time.sleep(1.0)
    return {
        "connections": count,
        "rss_mb_before": before,
        "rss_mb_with_connections": during,
        "frontend_kb_per_connection": (during[0] - before[0]) * 1024 / count,
        "health_while_open": health,
    }


def responsiveness(server: Server, prompt_mb: float) -> dict[str, Any]:
    """The longest gap between one stream's tokens over a window, alone and
    while a `prompt_mb` MB prompt is sent, tokenized and refused as too long.
    The stream is long enough to outlast the big request; the window runs
    from when the big request starts until 0.5 s after its answer (alone:
    as long)."""

    async def window(big: bool, seconds: float | None) -> tuple[float, float]:
        async with httpx.AsyncClient(timeout=600) as client:
            body = {"prompt": "once upon a time", "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            times: list[float] = []
            span: list[float] = []
            prompt = "word " * int(prompt_mb * 2**20 / 5)

            async def load() -> None:
                while len(times) < 10:
                    await asyncio.sleep(0.01)
                span.append(time.perf_counter())
                if big:
                    r = await client.post(server.url + "/v1/completions", json={"prompt": prompt})
                    assert r.status_code in (400, 413), r.status_code
                    await asyncio.sleep(0.5)
                else:
                    await asyncio.sleep(seconds or 1.0)
                span.append(time.perf_counter())

            async def stream() -> None:
                async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            times.append(time.perf_counter())
                        if len(span) == 2:
                            return  # leaving aborts the request

            await asyncio.gather(stream(), load())
            inside = [t for t in times if span[0] <= t <= span[1]]
            marks = [span[0], *inside, span[1]]
            return float(np.diff(marks).max()), span[1] - span[0]

    during, length = asyncio.run(window(True, None))
    alone, _ = asyncio.run(window(False, length))
    return {
        "prompt_mb": prompt_mb,
        "max_token_gap_alone_s": alone,
        "max_token_gap_with_big_prompt_s": during,
        "big_prompt_window_s": length,
    }


def responsiveness_runs(
    args: argparse.Namespace, name: str, pythonpath: Path | None
) -> list[dict[str, Any]]:
    runs = []
    for _ in range(args.repeats):
        server = Server(args.model, max_num_seqs=32, pythonpath=pythonpath)
        try:
            runs.append(responsiveness(server, args.prompt_mb))
        finally:
            server.stop()
        gap = runs[-1]["max_token_gap_with_big_prompt_s"]
        print(
            f"{name}: longest token gap with a {args.prompt_mb} MB prompt {gap:.3f} s", flush=True
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of mixed load")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--idle-connections", type=int, default=2000)
    parser.add_argument("--prompt-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3, help="of the responsiveness runs")
    parser.add_argument("--baseline", default=None, help="git ref to compare responsiveness with")
    parser.add_argument("--phases", default="soak,idle,responsive", help="which to run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv])}
    if phases & {"soak", "idle"}:
        server = Server(args.model, max_num_seqs=32)
        try:
            if "soak" in phases:
                result["soak"] = asyncio.run(soak(server, args))
                print(json.dumps(result["soak"], indent=2), flush=True)
            if "idle" in phases:
                result["idle"] = idle_connections(server, args.idle_connections)
                print(json.dumps(result["idle"], indent=2), flush=True)
        finally:
            result["exit_code"] = server.stop()
    if "responsive" not in phases:
        report(result)
        return
    result["responsiveness"] = {"current": responsiveness_runs(args, "current", None)}
    if args.baseline:
        sys.path.insert(0, str(Path(__file__).parent))
        from baseline import build_baseline, remove_baseline

        work = Path(tempfile.mkdtemp(prefix="ferrox-soak-"))
        try:
            python_path = build_baseline(args.baseline, work / "baseline")
            result["responsiveness"][f"baseline {args.baseline}"] = responsiveness_runs(
                args, args.baseline, python_path
            )
        finally:
            remove_baseline(work / "baseline")
            shutil.rmtree(work, ignore_errors=True)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def report(result: dict[str, Any]) -> None:
    if "soak" in result:
        soak_result = result["soak"]
        unexpected = sum(soak_result["errors"].values())
        print(
            f"\nsoak ({soak_result['duration_s']:.0f} s): served "
            f"{sum(soak_result['served'].values())} requests {soak_result['served']}, "
            f"{unexpected} unexpected answers {soak_result['errors']}, leaked KV blocks "
            f"{soak_result['leaked_kv_blocks']:.0f}, server exit code {result['exit_code']}"
        )
        first, end = soak_result["rss_mb_after_first_minute"], soak_result["rss_mb_end"]
        print(
            f"RSS frontend {first[0]:.0f} -> {end[0]:.0f} MB, engine {first[1]:.0f} -> "
            f"{end[1]:.0f} MB; TTFT p99 {soak_result['ttft_p99_first_minute_s']:.2f} s (first "
            f"minute) -> {soak_result['ttft_p99_last_minute_s']:.2f} s (last minute)"
        )
    if "idle" in result:
        idle = result["idle"]
        print(
            f"{idle['connections']} idle / half-sent connections: frontend "
            f"{idle['frontend_kb_per_connection']:.1f} KB each, /health "
            f"{idle['health_while_open']}"
        )
    for name, runs in result.get("responsiveness", {}).items():
        gaps = [r["max_token_gap_with_big_prompt_s"] for r in runs]
        alone = [r["max_token_gap_alone_s"] for r in runs]
        print(
            f"{name}: longest gap between a stream's tokens with a {runs[0]['prompt_mb']} MB "
            f"prompt arriving: median {np.median(gaps):.3f} s (range {min(gaps):.3f}-"
            f"{max(gaps):.3f}); alone {np.median(alone):.3f} s"
        )


if __name__ == "__main__":
    main()
