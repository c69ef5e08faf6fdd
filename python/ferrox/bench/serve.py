"""`ferrox bench serve`: a load generator for any OpenAI-compatible server.

Sessions arrive by a Poisson process (a gamma process with --burstiness
other than 1), turns of a session follow one another, --max-concurrency
bounds the requests in flight. Every request streams; the report gives
request and token throughput and TTFT / TPOT / ITL / E2E latency (mean, p50,
p90, p99), and the prefix-cache hit rate when the target's /metrics has it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ferrox.bench import require_bench_extra
from ferrox.bench.datasets import (
    PRESET_DEFAULTS,
    Session,
    Turn,
    add_dataset_arguments,
    build_sessions,
)


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer directory or .gguf (default: bundled)"
    )
    parser.add_argument("--endpoint", choices=["completions", "chat"], default=None)
    parser.add_argument(
        "--request-rate", type=float, nargs="+", default=None,
        help="sessions per second, 'inf' for all at once; several values run a sweep",
    )  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; < 1 burstier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly the output lengths"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--result-dir", default=None, help="write JSON results and PNG plots here")
    parser.add_argument("--label", default=None, help="name of this run in results")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_dataset_arguments(parser)


def apply_presets(args: argparse.Namespace) -> None:
    for key, value in PRESET_DEFAULTS.get(args.dataset_name, {}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.endpoint = args.endpoint or "completions"
    args.request_rate = args.request_rate or [float("inf")]


def load_tokenizer(path: str | None) -> Any:
    from ferrox.config import EngineConfig
    from ferrox.loader.model_loader import load_tokenizer as load

    return load(EngineConfig.create(model=path))


class Client:
    def __init__(self, args: argparse.Namespace, tokenizer: Any) -> None:
        import httpx

        self.args = args
        self.tokenizer = tokenizer
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=args.max_concurrency or 1000)
        self.http = httpx.AsyncClient(
            base_url=args.base_url, headers=headers, timeout=httpx.Timeout(3600), limits=limits
        )

    async def model_name(self) -> str:
        if self.args.model:
            return str(self.args.model)
        r = await self.http.get("/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    def body(self, session: Session, turn: Turn, model: str) -> tuple[str, dict[str, Any]]:
        messages = list(session.history)
        if turn.system is not None:
            messages.insert(0, {"role": "system", "content": turn.system})
        messages.append({"role": "user", "content": turn.user})
        common: dict[str, Any] = {
            "model": model,
            "max_tokens": turn.output_len,
            "temperature": self.args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.ignore_eos:
            common["ignore_eos"] = True
        if self.args.endpoint == "chat":
            return "/v1/chat/completions", {**common, "messages": messages}
        prompt = "\n\n".join(m["content"] for m in messages)
        return "/v1/completions", {**common, "prompt": prompt}

    async def send(self, session: Session, turn: Turn, model: str) -> RequestResult:
        path, body = self.body(session, turn, model)
        start = time.perf_counter()
        times: list[float] = []
        text: list[str] = []
        usage: dict[str, int] | None = None
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    return RequestResult(
                        False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    )
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return RequestResult(False, error=str(chunk["error"]))
                    usage = chunk.get("usage") or usage
                    piece = _chunk_text(chunk)
                    if piece:
                        times.append(time.perf_counter())
                        text.append(piece)
        except Exception as e:
            return RequestResult(False, error=f"{type(e).__name__}: {e}")
        end = time.perf_counter()
        output = "".join(text)
        session.history += [
            {"role": "user", "content": turn.user},
            {"role": "assistant", "content": output},
        ]
        if usage:
            prompt_tokens, output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        else:
            prompt_tokens = len(
                self.tokenizer.encode(body.get("prompt") or json.dumps(body["messages"]))
            )
            output_tokens = len(self.tokenizer.encode(output, add_special_tokens=False))
        return RequestResult(
            ok=True,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            ttft=(times[0] if times else end) - start,
            e2e=end - start,
            itls=[b - a for a, b in itertools.pairwise(times)],
        )

    async def metric_totals(self) -> dict[str, float]:
        """Prefix-cache counters from /metrics (ferrox: or vllm: names), if any."""
        try:
            r = await self.http.get("/metrics")
        except Exception:
            return {}
        totals: dict[str, float] = {}
        for line in r.text.splitlines() if r.status_code == 200 else []:
            for key in ("prefix_cache_hits", "prefix_cache_queries"):
                if line.split("{")[0].split(" ")[0].endswith(f":{key}_total"):
                    totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return str(c["delta"].get("content") or "")
    return str(c.get("text") or "")


async def run_once(args: argparse.Namespace, tokenizer: Any, rate: float) -> dict[str, Any]:
    from tqdm.auto import tqdm

    sessions = build_sessions(args, tokenizer)
    client = Client(args, tokenizer)
    model = await client.model_name()
    total = sum(len(s.turns) for s in sessions)
    bar = tqdm(total=total, desc=f"rate {rate}", disable=args.disable_tqdm)
    limit = asyncio.Semaphore(args.max_concurrency or total)
    results: list[RequestResult] = []
    rng = np.random.default_rng(args.seed)

    async def run_session(session: Session, delay: float) -> None:
        await asyncio.sleep(delay)
        for turn in session.turns:
            async with limit:
                results.append(await client.send(session, turn, model))
            bar.update(1)

    before = await client.metric_totals()
    start = time.perf_counter()
    delays = _arrival_times(len(sessions), rate, args.burstiness, rng)
    await asyncio.gather(*(run_session(s, d) for s, d in zip(sessions, delays, strict=True)))
    duration = time.perf_counter() - start
    after = await client.metric_totals()
    bar.close()
    await client.http.aclose()
    report = summarize(results, duration)
    queries = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
    if queries > 0:
        report["prefix_cache_hit_rate"] = (
            after["prefix_cache_hits"] - before["prefix_cache_hits"]
        ) / queries
    report.update(
        label=args.label, model=model, base_url=args.base_url, dataset=args.dataset_name,
        endpoint=args.endpoint, request_rate=rate, max_concurrency=args.max_concurrency,
        burstiness=args.burstiness, num_prompts=total, seed=args.seed,
    )  # fmt: skip
    report["_raw"] = [asdict(r) for r in results]
    return report


def _arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps).tolist()


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * scale
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / duration,
        "output_tok_s": sum(r.output_tokens for r in ok) / duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for r in ok for g in r.itls]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def print_report(report: dict[str, Any]) -> None:
    rows = [
        ("completed / failed", f"{report['completed']} / {report['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{report['request_throughput']:.3f}"),
        ("input tokens/s", f"{report['input_tok_s']:.1f}"),
        ("output tokens/s", f"{report['output_tok_s']:.1f}"),
    ]
    if "prefix_cache_hit_rate" in report:
        rows.append(("prefix cache hit rate", f"{report['prefix_cache_hit_rate']:.1%}"))
    print(f"==== {report['dataset']} @ rate {report['request_rate']} ({report['model']}) ====")
    for name, value in rows:
        print(f"{name:<30}{value:>16}")
    print(f"{'latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[key]
        print(
            f"{key[:-3].upper():<16}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}"
        )
    for error in report["errors"]:
        print(f"error: {error}")


def main(args: argparse.Namespace) -> int:
    # Checked before any request is sent, not after the run.
    require_bench_extra("httpx", "ferrox bench serve")
    if args.result_dir:
        require_bench_extra("matplotlib", "ferrox bench serve --result-dir (plots)")
    apply_presets(args)
    tokenizer = load_tokenizer(args.tokenizer)
    reports = []
    seed = args.seed
    for i, rate in enumerate(args.request_rate):
        # Each point of a sweep gets its own prompts: no cache hits carried
        # over from the previous point.
        args.seed = seed + i
        report = asyncio.run(run_once(args, tokenizer, rate))
        print_report(report)
        reports.append(report)
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{args.label or 'bench'}-{args.dataset_name}"
        (out / f"{stem}.json").write_text(json.dumps(reports, indent=2, default=str))
        from ferrox.bench.plots import plot_reports

        for path in plot_reports(reports, out, stem):
            print(f"wrote {path}")
    args.seed = seed
    return 0 if all(r["failed"] == 0 for r in reports) else 1
