"""`ferrox serve` as the README's first command runs it: the default model on
127.0.0.1, one chat completion through the HTTP API, a short `ferrox bench
serve` against it, then SIGINT and a clean exit. Standard library only, so
it runs in an environment that has nothing but ferrox and its declared
dependencies."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 600  # the first run downloads the default model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except (urllib.error.URLError, OSError):
        return 0


def main() -> int:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(["ferrox", "serve", "--port", str(port)])
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while get(f"{base}/health") != 200:
            if server.poll() is not None:
                print(f"ferrox serve exited with {server.returncode} before it was ready")
                return 1
            if time.monotonic() > deadline:
                print(f"ferrox serve was not ready within {STARTUP_TIMEOUT_S} s")
                return 1
            time.sleep(0.5)
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{base}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        text = reply["choices"][0]["message"]["content"]
        usage = reply["usage"]
        print(f"chat completion: {text!r} ({usage['completion_tokens']} tokens)")
        if not text or usage["completion_tokens"] < 1:
            print("the reply is empty")
            return 1
        with tempfile.TemporaryDirectory() as results:
            bench = subprocess.run(
                ["ferrox", "bench", "serve", "--base-url", base, "--num-prompts", "4",
                 "--random-input-len", "16", "--random-output-len", "4", "--disable-tqdm",
                 "--save-result", "--result-dir", results, "--result-filename", "r.json"],
                check=False,
            )  # fmt: skip
            if bench.returncode != 0:
                print(f"ferrox bench serve exited with {bench.returncode}")
                return 1
            saved = json.loads((Path(results) / "r.json").read_text())
            print(f"ferrox bench serve: {saved['completed']} requests, "
                  f"{saved['output_throughput']:.1f} output tok/s")  # fmt: skip
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    if server.returncode != 0:
        print(f"ferrox serve exited with {server.returncode} after SIGINT")
        return 1
    print("ferrox serve: started, answered, stopped cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
