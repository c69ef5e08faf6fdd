"""The Ray Serve application (`ferrox.server.ray_serve`): its arguments, and
one served run behind Serve's HTTP proxy on a local Ray."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ferrox.common.errors import InvalidArgumentError
from ferrox.server.ray_serve import app_options, parse_serve_args, serve_argv
from tests.live_server import HTTP, MODEL


def test_arguments_become_ferrox_serve_flags() -> None:
    argv = serve_argv(
        {
            "model": "/m",
            "data-parallel-size": 2,
            "served_model_name": "a b",
            "enable-prefix-caching": "false",
            "disable-log-requests": "true",
            "num-replicas": 3,
        }
    )
    assert argv == [
        "--model",
        "/m",
        "--data-parallel-size",
        "2",
        "--served-model-name",
        "a",
        "b",
        "--disable-log-requests",
    ]
    args = parse_serve_args(argv)
    assert (args.model, args.data_parallel_size, args.served_model_name) == ("/m", 2, ["a", "b"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"model": "/m", "port": 9000}, "Serve's HTTP proxy"),
        ({"model": "/m", "no-such-option": 1}, "unknown option"),
        ({"model": "/m", "pipeline-parallel-size": 2}, "vLLM option ferrox does not support"),
        ({"model": "/m", "disable-log-requests": "maybe"}, "switch"),
        ({"model": "/m", "max-num-seqs": "many"}, "bad ferrox serve options"),
    ],
)
def test_bad_arguments_are_refused(options: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_serve_args(serve_argv(options))


def test_application_options_are_checked() -> None:
    assert app_options({"model": "/m"}) == (1, 1.0, 10.0)
    assert app_options({"num_replicas": "3", "replica-cpus": 0.5}) == (3, 0.5, 10.0)
    assert app_options({"health_check_period_s": "2"})[2] == 2.0
    for bad in (
        {"num-replicas": "many"},
        {"num-replicas": 0},
        {"num-replicas": 2.5},
        {"num-replicas": 10**9},
        {"replica-cpus": "nan"},
        {"replica-cpus": "inf"},
        {"replica-cpus": -1},
        {"health-check-period-s": 0},
        {"health-check-period-s": "nan"},
        {"health-check-period-s": "soon"},
        {"replica-cpus": [1]},
    ):
        with pytest.raises(InvalidArgumentError, match=r"num-replicas|health-check-period-s"):
            app_options(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The Ray driver runs in a process of its own: Ray started and shut down more
# than once in one process (the test process) may crash it at exit.
_SERVE_DRIVER = """
import sys
import ray
from ray import serve
from ferrox.server.ray_serve import build_app

model, name, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
try:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {"model": model, "served-model-name": name, "num-kv-blocks": 64, "health-check-period-s": 2}
    )
    serve.run(app, name="ferrox", route_prefix="/", blocking=False)
    sys.stdin.read()  # until the test closes it
finally:
    serve.shutdown()
    ray.shutdown()
"""


@pytest.fixture(scope="module")
def serve_url(model_dir: Path) -> Iterator[str]:
    pytest.importorskip("ray.serve")
    port = _free_port()
    driver = subprocess.Popen(
        [sys.executable, "-c", _SERVE_DRIVER, str(model_dir), MODEL, str(port)],
        stdin=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and driver.poll() is None:
            try:
                if HTTP.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the Serve application did not become healthy")
        yield url
    finally:
        assert driver.stdin is not None
        driver.stdin.close()
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()


def test_serve_application_answers_like_ferrox_serve(serve_url: str) -> None:
    models = HTTP.get(serve_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    r = HTTP.post(serve_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == 5
    # Streaming goes through the proxy chunk by chunk.
    chunks = []
    with HTTP.stream(
        "POST", serve_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == answer["choices"][0]["message"]["content"]
    # Errors keep the OpenAI envelope and status.
    bad = HTTP.post(serve_url + "/v1/chat/completions", json={**body, "n": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"]
    # Nothing is left behind in the engine once idle.
    metrics = HTTP.get(serve_url + "/metrics", timeout=30).text
    used = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(("ferrox:kv_cache_used_blocks{", "ferrox:kv_cache_used_blocks "))
    ]
    assert used and all(u == 0 for u in used), metrics[:2000]


def _engine_pids() -> list[int]:
    """Engine processes started by a Serve replica of the application."""
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            parent = proc.parent()
            if (
                parent is not None
                and "ServeReplica:ferrox" in " ".join(parent.cmdline())
                and "engine_process_main" in " ".join(proc.info["cmdline"] or [])
            ):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def test_a_replica_whose_engine_dies_is_replaced(serve_url: str) -> None:
    (engine,) = _engine_pids()
    os.kill(engine, signal.SIGKILL)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0.0}
    # Serve's health check finds the dead engine and starts a new replica;
    # meanwhile requests fail cleanly (the proxy or the old replica's 503).
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        try:
            r = HTTP.post(serve_url + "/v1/completions", json=body, timeout=30)
        except httpx.HTTPError:
            r = None
        if r is not None and r.status_code == 200 and _engine_pids() not in ([], [engine]):
            break
        assert r is None or r.status_code in (200, 500, 503), r.text
        time.sleep(1.0)
    else:
        pytest.fail("the replica was not replaced")
    assert engine not in _engine_pids()
