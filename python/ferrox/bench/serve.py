"""`ferrox bench serve`: a load generator for any OpenAI-compatible server.

Sessions arrive by a Poisson process (a gamma process with --burstiness
other than 1), turns of a session follow one another, --max-concurrency
bounds the requests in flight. Every request streams; the report gives
request and token throughput, goodput under --goodput SLOs, and TTFT / TPOT
/ ITL / E2EL latency (mean, median, std and --metric-percentiles), and the
prefix-cache hit rate when the target's /metrics has it.

The result (--save-result) is a flat JSON object with `vllm bench serve`'s
keys (`completed`, `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`,
per-request `input_lens` / `output_lens` / `ttfts` / `itls` / `errors`, ...)
plus ferrox's own (`prefix_cache_hit_rate`, `dataset`, `request_rate`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass, field
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
from ferrox.common.errors import InvalidArgumentError


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    json_ok: bool | None = None  # with --json-schema: the output parsed as JSON


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
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask for exactly the output lengths (default: on for the random dataset)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--json-schema",
        type=_json_schema,
        default=None,
        metavar="FILE_OR_JSON",
        help="every request's output must match this JSON schema (response_format on chat, "
        "structured_outputs on completions): the data-processing workload",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--save-result", action="store_true", help="write the result JSON (one per request rate)"
    )
    parser.add_argument(
        "--result-dir", default=None, help="where results go (and PNG plots; default: .)"
    )
    parser.add_argument("--result-filename", default=None, help="the JSON's name (one rate)")
    parser.add_argument(
        "--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="added to the result"
    )
    parser.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="metrics whose percentiles are reported: ttft,tpot,itl,e2el",
    )
    parser.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 25,50,99"
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs (ttft, tpot, e2el in ms) a request must meet to count in request_goodput",
    )
    parser.add_argument("--label", default=None, help="name of this run in results")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_dataset_arguments(parser)


def apply_presets(args: argparse.Namespace) -> None:
    for key, value in PRESET_DEFAULTS.get(args.dataset_name, {}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.endpoint = args.endpoint or "completions"
    if args.ignore_eos is None:  # as vLLM: exact output lengths for random prompts
        args.ignore_eos = args.dataset_name == "random"
    args.request_rate = args.request_rate or [float("inf")]


def load_tokenizer(path: str | None) -> Any:
    from ferrox.common.config import EngineConfig
    from ferrox.model_files.tokenizer import load_tokenizer as load

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
        schema = self.args.json_schema
        if schema is not None and self.args.endpoint == "chat":
            spec = {"name": "bench", "schema": schema}
            common["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif schema is not None:
            common["structured_outputs"] = {"json": schema}
        if self.args.endpoint == "chat":
            return "/v1/chat/completions", {**common, "messages": messages}
        prompt = "\n\n".join(m["content"] for m in messages)
        return "/v1/completions", {**common, "prompt": prompt}

    async def send(self, session: Session, turn: Turn, model: str) -> RequestResult:
        import httpx

        path, body = self.body(session, turn, model)
        start = time.perf_counter()
        times: list[float] = []
        text: list[str] = []
        usage: dict[str, int] | None = None
        for attempt in (1, 2):
            answered = False
            try:
                async with self.http.stream("POST", path, json=body) as r:
                    answered = True
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
                break
            except httpx.RemoteProtocolError as e:
                # A server may close a kept-alive connection just as the next
                # request goes out on it (cpp-httplib does after a few
                # requests): sent again once, on a new connection.
                if answered or attempt == 2:
                    return RequestResult(False, error=f"{type(e).__name__}: {e}")
                start = time.perf_counter()
            except Exception as e:
                return RequestResult(False, error=f"{type(e).__name__}: {e}")
        end = time.perf_counter()
        output = "".join(text)
        if turn.system is not None and not session.history:
            # the system prompt stays at the head of every later turn
            session.history.append({"role": "system", "content": turn.system})
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
            json_ok=None if self.args.json_schema is None else _parses(output),
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
    report = summarize(results, duration, _percentiles(args), parse_goodput(args.goodput))
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
    report.update(_metadata(args.metadata))
    return report


def _arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps).tolist()


METRICS = ("ttft", "tpot", "itl", "e2el")


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """--goodput ttft:500 tpot:50 -> {"ttft": 500.0, "tpot": 50.0} (ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise InvalidArgumentError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


def summarize(
    results: list[RequestResult],
    duration: float,
    percentiles: tuple[float, ...] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The flat report, with `vllm bench serve`'s keys."""
    ok = [r for r in results if r.ok]
    per_request: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [g for r in ok for g in r.itls],
        "e2el": [r.e2e for r in ok],
    }
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    report: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
    }
    checked = [r.json_ok for r in ok if r.json_ok is not None]
    if checked:
        report["json_valid_fraction"] = sum(checked) / len(checked)
    if goodput:
        good = [r for r in ok if _meets(r, goodput)]
        report["request_goodput"] = len(good) / duration
    for metric in METRICS:
        values = np.asarray(per_request[metric]) * 1000.0
        empty = values.size == 0
        report[f"mean_{metric}_ms"] = float("nan") if empty else float(values.mean())
        report[f"median_{metric}_ms"] = float("nan") if empty else float(np.median(values))
        report[f"std_{metric}_ms"] = float("nan") if empty else float(values.std())
        for p in sorted({99.0, *percentiles}):
            key = f"p{_percentile_name(p)}_{metric}_ms"
            report[key] = float("nan") if empty else float(np.percentile(values, p))
    report.update(
        input_lens=[r.prompt_tokens for r in results],
        output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results],
        e2els=[r.e2e for r in results],
        itls=[r.itls for r in results],
        errors=[r.error for r in results],
    )
    return report


def _json_schema(text: str) -> dict[str, Any]:
    """--json-schema: a file holding a JSON schema, or the schema itself."""
    path = Path(text)
    try:
        value = json.loads(path.read_text() if path.is_file() else text)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not a JSON schema file or text: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON schema must be a JSON object")
    return value


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {
        "ttft": r.ttft * 1e3,
        "e2el": r.e2e * 1e3,
        "tpot": (r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 if r.output_tokens > 1 else 0.0,
    }
    return all(values[name] <= limit for name, limit in slos.items())


def print_report(
    report: dict[str, Any],
    metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
    percentiles: tuple[float, ...] = (99.0,),
) -> None:
    rows = [
        ("completed / failed", f"{report['completed']} / {report['failed']}"),
        ("duration (s)", f"{report['duration']:.2f}"),
        ("request throughput (req/s)", f"{report['request_throughput']:.3f}"),
        ("output throughput (tok/s)", f"{report['output_throughput']:.1f}"),
        ("total token throughput (tok/s)", f"{report['total_token_throughput']:.1f}"),
    ]
    if "request_goodput" in report:
        rows.append(("request goodput (req/s)", f"{report['request_goodput']:.3f}"))
    if "prefix_cache_hit_rate" in report:
        rows.append(("prefix cache hit rate", f"{report['prefix_cache_hit_rate']:.1%}"))
    if "json_valid_fraction" in report:
        rows.append(("outputs that parse as JSON", f"{report['json_valid_fraction']:.1%}"))
    print(f"==== {report['dataset']} @ rate {report['request_rate']} ({report['model']}) ====")
    for name, value in rows:
        print(f"{name:<32}{value:>16}")
    names = ["mean", "median", "std", *(f"p{_percentile_name(p)}" for p in percentiles)]
    print(f"{'latency (ms)':<16}" + "".join(f"{n:>10}" for n in names))
    for metric in metrics:
        cells = [report[f"{n}_{metric}_ms"] for n in names]
        print(f"{metric.upper():<16}" + "".join(f"{c:>10.1f}" for c in cells))
    for error in sorted({e for e in report["errors"] if e})[:5]:
        print(f"error: {error}")


def _percentiles(args: argparse.Namespace) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise InvalidArgumentError(
            f"--metric-percentiles takes numbers such as 25,50,99, got {args.metric_percentiles!r}"
        ) from None


def _metrics(args: argparse.Namespace) -> tuple[str, ...]:
    names = tuple(m for m in args.percentile_metrics.split(",") if m)
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise InvalidArgumentError(f"--percentile-metrics knows {METRICS}, not {unknown}")
    return names


def _metadata(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgumentError(f"--metadata takes KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def main(args: argparse.Namespace) -> int:
    # Checked before any request is sent, not after the run.
    if args.result_dir and not args.save_result:
        require_bench_extra("matplotlib", "ferrox bench serve --result-dir (plots)")
    metrics, percentiles = _metrics(args), _percentiles(args)
    parse_goodput(args.goodput)
    _metadata(args.metadata)
    apply_presets(args)
    tokenizer = load_tokenizer(args.tokenizer)
    reports = []
    seed = args.seed
    for i, rate in enumerate(args.request_rate):
        # Each point of a sweep gets its own prompts: no cache hits carried
        # over from the previous point.
        args.seed = seed + i
        report = asyncio.run(run_once(args, tokenizer, rate))
        print_report(report, metrics, percentiles)
        reports.append(report)
    args.seed = seed
    out = Path(args.result_dir or ".")
    if args.save_result:
        out.mkdir(parents=True, exist_ok=True)
        for report in reports:
            path = out / _result_filename(args, report, len(reports))
            path.write_text(json.dumps(report, indent=2, default=str))
            print(f"wrote {path}")
    elif args.result_dir:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{args.label or 'bench'}-{args.dataset_name}"
        (out / f"{stem}.json").write_text(json.dumps(reports, indent=2, default=str))
        from ferrox.bench.plots import plot_reports

        for path in plot_reports(reports, out, stem):
            print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in reports) else 1


def _result_filename(args: argparse.Namespace, report: dict[str, Any], count: int) -> str:
    if args.result_filename and count == 1:
        return str(args.result_filename)
    rate = "inf" if math.isinf(report["request_rate"]) else f"{report['request_rate']:g}"
    model = str(report["model"]).replace("/", "-")
    stem = args.result_filename.removesuffix(".json") if args.result_filename else "ferrox"
    return f"{stem}-{rate}qps-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
