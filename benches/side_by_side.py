"""ferrox and `transformers serve --continuous-batching` on the same model and
the same workload, one after the other, with one table of ratios.

    pip install "transformers[serving]"     # transformers' server needs FastAPI
    python benches/side_by_side.py --dataset-name chat --num-prompts 12 --request-rate 1

Both servers load the same float32 weights: the bundled SmolLM2-135M GGUF is
written out once as a Hugging Face directory (safetensors + tokenizer) under
the ferrox cache, and each server is pointed at that directory. Any option of
`ferrox bench serve` (dataset, rate, concurrency, lengths) can be given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ferrox.bench import serve as bench


def hf_directory() -> Path:
    """The default model as a Hugging Face directory (written once)."""
    from transformers import LlamaForCausalLM

    from ferrox.loader.gguf import load_gguf
    from ferrox.model_files import default_model_path
    from ferrox.model_files.default import cache_dir

    out = cache_dir() / "SmolLM2-135M-Instruct-hf"
    if (out / "config.json").exists():
        return out
    gguf = load_gguf(default_model_path())
    model = LlamaForCausalLM(gguf.config)
    model.load_state_dict(gguf.state_dict, strict=False)
    model.tie_weights()
    model.save_pretrained(out)
    gguf.tokenizer.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(command: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    import httpx

    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{command} did not start; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    bench.add_arguments(parser)
    parser.add_argument("--transformers-bin", default="transformers", help="the transformers CLI")
    parser.add_argument("--logs", default="side-by-side-logs")
    args = parser.parse_args()
    bench.apply_presets(args)
    model = hf_directory()
    args.tokenizer = str(model)
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    servers = {
        "ferrox": lambda port: [
            sys.executable, "-m", "ferrox", "serve", "--model", str(model), "--port", str(port),
            "--served-model-name", "model",
        ],
        "transformers": lambda port: [
            args.transformers_bin, "serve", str(model), "--continuous-batching",
            "--port", str(port), "--host", "127.0.0.1",
        ],
    }  # fmt: skip
    tokenizer = bench.load_tokenizer(args.tokenizer)
    reports = {}
    for name, command in servers.items():
        port = free_port()
        proc = start(command(port), port, logs / f"{name}.log")
        try:
            args.base_url = f"http://127.0.0.1:{port}"
            args.model = None if name == "ferrox" else str(model)
            args.label = name
            reports[name] = asyncio.run(bench.run_once(args, tokenizer, args.request_rate[0]))
            bench.print_report(reports[name])
        finally:
            stop(proc)
    ours, theirs = reports["ferrox"], reports["transformers"]
    rows = [
        ("completed", "completed"),
        ("failed", "failed"),
        ("output tok/s", "output_throughput"),
        ("request/s", "request_throughput"),
        ("TTFT p50 (ms)", "median_ttft_ms"),
        ("TTFT p99 (ms)", "p99_ttft_ms"),
        ("TPOT p50 (ms)", "median_tpot_ms"),
        ("E2E p50 (ms)", "median_e2el_ms"),
    ]
    print(f"\n{'metric':<16}{'ferrox':>12}{'transformers':>14}{'ratio':>10}")
    table = []
    for label, key in rows:
        a, b = ours[key], theirs[key]
        ratio = a / b if b else float("nan")
        table.append({"metric": label, "ferrox": a, "transformers": b, "ratio": ratio})
        print(f"{label:<16}{a:>12.1f}{b:>14.1f}{ratio:>10.2f}")
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"side-by-side-{args.dataset_name}.json"
        meta = {"dataset": args.dataset_name, "rate": args.request_rate[0], "cpus": os.cpu_count()}
        path.write_text(json.dumps({"meta": meta, "table": table}, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
