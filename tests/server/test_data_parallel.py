"""Data parallelism: the replica pool's routing (fake replicas), and
`ferrox serve --data-parallel-size 2` with replicas placed by a local Ray:
a chat load over several system prompts, prefix routing against round robin,
and a replica killed under load."""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from ferrox.common import protocol as p
from ferrox.common.errors import EngineDeadError
from ferrox.frontend.replicas import ROUTE_BLOCK_TOKENS, ReplicaPool, block_hashes
from tests.live_server import HTTP, MODEL, Server

# ---------------------------------------------------------------- routing


class FakeClient:
    def __init__(self) -> None:
        self.streams: dict[str, Any] = {}
        self.is_dead = False
        self.dead_message = ""
        self.is_stalled = False
        self.last_message_at = 0.0
        self.refuse_new = False
        self.stats = p.EngineStats()
        self.on_step: Any = None
        self.on_dead: Any = None


def _pool(n: int, routing: str = "prefix") -> ReplicaPool:
    return ReplicaPool(lambda i: FakeClient(), n, routing)  # type: ignore[arg-type,return-value]


def _prompt(system: int, user: int) -> list[int]:
    return [1000 + system] * 48 + [user, user + 1, user + 2]


def test_prefix_routing_keeps_a_prefix_on_one_replica() -> None:
    pool = _pool(3)
    first = {s: pool.pick(_prompt(s, 0)) for s in range(3)}
    assert len({id(c) for c in first.values()}) == 3  # new prefixes spread out
    for user in range(1, 6):
        for s in range(3):
            assert pool.pick(_prompt(s, user)) is first[s]


def test_a_busy_replica_sheds_new_requests_to_the_least_busy() -> None:
    pool = _pool(2)
    home = pool.pick(_prompt(0, 0))
    other = next(c for c in pool.clients if c is not home)
    home.streams.update({str(i): None for i in range(2)})
    assert pool.pick(_prompt(0, 1)) is home  # a little busier: the prefix wins
    home.streams.update({str(i): None for i in range(10)})
    assert pool.pick(_prompt(0, 2)) is other  # much busier: load wins


def test_round_robin_and_dead_replicas() -> None:
    pool = _pool(3, "round_robin")
    picks = [pool.pick(_prompt(0, u)) for u in range(6)]
    assert picks == pool.clients * 2
    pool.clients[1].is_dead = True
    assert all(pool.pick(_prompt(0, u)) is not pool.clients[1] for u in range(6))
    prefix = _pool(2)
    home = prefix.pick(_prompt(0, 0))
    home.is_dead = True
    assert prefix.pick(_prompt(0, 1)) is not home
    for client in prefix.clients:
        client.is_dead = True
    with pytest.raises(EngineDeadError):
        prefix.pick(_prompt(0, 2))


def test_bad_data_parallel_options_are_refused(tiny_models: dict[str, Path]) -> None:
    from ferrox import AsyncLLM
    from ferrox.common.errors import InvalidArgumentError
    from ferrox.server.launch import build_parser

    path = str(tiny_models["llama-gqa-tied"])
    for size in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="data_parallel_size"):
            AsyncLLM(path, data_parallel_size=size)
    with pytest.raises(InvalidArgumentError, match="routing"):
        AsyncLLM(path, data_parallel_size=2, routing="random")
    for argv in (["--data-parallel-size", "0"], ["--data-parallel-routing", "random"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)


def test_block_hashes_chain_whole_blocks() -> None:
    a = block_hashes(list(range(40)))
    assert len(a) == 40 // ROUTE_BLOCK_TOKENS
    b = block_hashes(list(range(32)) + [7] * 8)
    assert a[:2] == b[:2]
    c = block_hashes([99, *range(1, 40)])
    assert c[0] != a[0] and c[1] != a[1]  # a block's hash depends on what comes before


# ---------------------------------------------------------------- served


SYSTEMS = [
    f"You are assistant number {i}. " + " ".join(f"rule{i}-{j}" for j in range(10))
    for i in range(4)
]


def _chat_load(server: Server, seed: int = 0) -> tuple[int, list[str]]:
    """5 questions to each of 4 system prompts, one at a time in a shuffled
    order; (requests answered, errors)."""
    order = [(s, q) for s in range(4) for q in range(5)]
    random.Random(seed).shuffle(order)
    errors, done = [], 0
    for s, q in order:
        r = server.post(
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": SYSTEMS[s]},
                    {"role": "user", "content": f"question {q}"},
                ],
                "max_tokens": 4,
            },
        )
        if r.status_code == 200:
            done += 1
        else:
            errors.append(r.text)
    return done, errors


def _replicas(server: Server) -> list[psutil.Process]:
    """The server's replica processes (Ray workers it started, among its
    descendants: not those of a server that is still shutting down)."""
    found = []
    try:
        descendants = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for proc in descendants:
        try:
            if "EngineReplica" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture(scope="module")
def served_model(model_dir: Path) -> Path:
    pytest.importorskip("ray")
    return model_dir


def test_more_replicas_than_the_cluster_holds_are_refused(served_model: Path) -> None:
    # In a process of its own: Ray started and shut down more than once in one
    # process (the test process) may crash it at exit.
    script = (
        "import sys\n"
        "from ferrox import AsyncLLM\n"
        "from ferrox.common.errors import InvalidArgumentError\n"
        "try:\n"
        "    AsyncLLM(sys.argv[1], data_parallel_size=10**6)\n"
        "except InvalidArgumentError as e:\n"
        "    print('InvalidArgumentError:', e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(served_model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search("InvalidArgumentError: .*data_parallel_size=1000000 needs", run.stdout)


def test_prefix_routing_beats_round_robin(served_model: Path) -> None:
    hit_rates = {}
    for routing in ("round_robin", "prefix"):
        server = Server(
            served_model, "--data-parallel-size", "2", "--data-parallel-routing", routing
        )
        try:
            done, errors = _chat_load(server)
            assert (done, errors) == (20, [])
            hit_rates[routing] = server.metric("prefix_cache_hits_total") / server.metric(
                "prefix_cache_queries_total"
            )
            server.wait_idle()
            assert server.metric("kv_cache_used_blocks") == 0
        finally:
            server.stop()
    assert hit_rates["prefix"] > hit_rates["round_robin"], hit_rates


def test_a_killed_replica_fails_only_its_requests_and_comes_back(served_model: Path) -> None:
    server = Server(served_model, "--data-parallel-size", "2")
    try:
        pids = [proc.pid for proc in _replicas(server)]
        assert len(pids) == 2

        def request(i: int) -> tuple[int, str]:
            body = {
                "model": MODEL,
                "prompt": f"request {i} " + SYSTEMS[i % 4],
                "max_tokens": 48,
                "ignore_eos": True,
            }
            with httpx.Client(timeout=60) as client:
                r = client.post(server.url + "/v1/completions", json=body, headers=server.headers)
            return r.status_code, r.text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(request, i) for i in range(8)]
            time.sleep(1.0)  # the requests are running on both replicas
            os.kill(pids[0], signal.SIGKILL)
            codes = [f.result(timeout=90)[0] for f in futures]  # none hangs
        assert 200 in codes  # the other replica's requests finished
        assert set(codes) <= {200, 500, 503}, codes
        # new requests go to the live replica meanwhile, and the dead one comes back
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(_replicas(server)) < 2:
            code, text = request(100)
            assert code == 200, text
            time.sleep(0.5)
        assert len(_replicas(server)) == 2
        assert [request(200 + i)[0] for i in range(4)] == [200] * 4
        assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        replicas = _replicas(server)
        server.stop()
    assert psutil.wait_procs(replicas, timeout=20)[1] == []
