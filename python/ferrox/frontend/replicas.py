"""Data parallelism: several engine replicas behind one frontend.

Each replica is a whole engine (its own scheduler, KV cache and prefix
cache) in a Ray actor, placed by Ray on any node of the cluster; the
frontend talks to it as to a local engine process, over ZMQ (tcp:// on the
frontend's node address instead of ipc://), so requests, streams, aborts,
heartbeats and stall detection are the single-engine path's.

`ReplicaPool` routes each request (`pick`): to the live replica most likely
to hold its prompt's prefix in its cache (the longest run of leading
16-token blocks it has been sent before, when that is half the prompt or
512 tokens), unless that replica has clearly more requests in flight than
the least busy one; otherwise to the least busy replica. A
replica that dies fails only its own requests; the pool starts a new one in
its place and routes around it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq

from ferrox.common import protocol as p
from ferrox.common.errors import EngineDeadError, InvalidArgumentError, MissingDependencyError
from ferrox.frontend.engine_client import AsyncEngineClient, engine_process_main

logger = logging.getLogger("ferrox.replicas")

ROUTING_POLICIES = ("prefix", "round_robin")
ROUTE_BLOCK_TOKENS = 16  # prefix granularity of the routing index
ROUTE_INDEX_BLOCKS = 200_000  # remembered blocks per replica (least recently used go)
# A replica holds a prompt's prefix when it was sent this share of the
# prompt's blocks, or this many of them.
ROUTE_MIN_SHARE = 0.5
ROUTE_MIN_BLOCKS = 32
# The prefix's replica takes a request unless it has this many more requests
# in flight than the least busy replica (and this fraction more).
IMBALANCE_REQUESTS = 4
IMBALANCE_RATIO = 1.5
RESTART_ATTEMPTS = 3


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            "data parallelism places its replicas with Ray: pip install 'ray>=2.9'"
        ) from exc
    return ray


def check_routing(routing: str) -> None:
    if routing not in ROUTING_POLICIES:
        raise InvalidArgumentError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")


@functools.cache
def _replica_actor_class() -> Any:
    class EngineReplica:
        """Runs the engine-core loop, connected to the frontend's sockets."""

        def run(self, options: dict[str, Any], input_address: str, output_address: str) -> None:
            engine_process_main(options, input_address, output_address)

    return _ray().remote(EngineReplica)


class RayEngineProcess:
    """An engine replica in a Ray actor (the `process` of an AsyncEngineClient)."""

    def __init__(self, resources: dict[str, float], name: str) -> None:
        self.resources = resources
        self.name = name
        self._actor: Any = None
        self._run: Any = None

    def bind(self, to_engine: zmq.Socket, from_engine: zmq.Socket) -> tuple[str, str]:
        """On loopback when the Ray cluster is this machine alone, else on
        this node's cluster address (the engine sockets carry no
        authentication: keep the cluster network private)."""
        ray = _ray()
        host = ray.util.get_node_ip_address()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if all(n.get("NodeManagerAddress") == host for n in nodes):
            host = "127.0.0.1"
        input_port = to_engine.bind_to_random_port(f"tcp://{host}")
        output_port = from_engine.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{input_port}", f"tcp://{host}:{output_port}"

    def start(self, options: dict[str, Any], input_address: str, output_address: str) -> None:
        actor_class = _replica_actor_class()
        self._actor = actor_class.options(name=None, max_restarts=0, **self.resources).remote()
        self._run = self._actor.run.remote(options, input_address, output_address)

    def is_alive(self) -> bool:
        if self._run is None:
            return False
        done, _ = _ray().wait([self._run], timeout=0)
        return not done

    def exit_description(self) -> str:
        try:
            _ray().get(self._run, timeout=1)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"engine replica {self.name} ended: {first}"
        return f"engine replica {self.name} ended"

    def kill(self) -> None:
        if self._actor is not None:
            _ray().kill(self._actor)

    def join(self, timeout: float) -> None:
        if self._run is not None:
            with contextlib.suppress(Exception):
                _ray().wait([self._run], timeout=timeout)

    def cleanup(self) -> None:
        self._actor = None

    @property
    def pid(self) -> int | None:
        return None  # on whichever node Ray placed it


class _PrefixIndex:
    """Chained hashes of the leading 16-token blocks of prompts one replica
    was sent, most recent last (bounded)."""

    def __init__(self, capacity: int = ROUTE_INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def block_hashes(prompt_token_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    previous = b""
    full = len(prompt_token_ids) - len(prompt_token_ids) % ROUTE_BLOCK_TOKENS
    for start in range(0, full, ROUTE_BLOCK_TOKENS):
        block = prompt_token_ids[start : start + ROUTE_BLOCK_TOKENS]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in block))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class ReplicaPool:
    """N engine replicas with one client's interface (see AsyncEngineClient:
    `pick`, `replica_stats`, health, control messages, shutdown)."""

    def __init__(
        self, make_client: Callable[[int], AsyncEngineClient], size: int, routing: str = "prefix"
    ) -> None:
        check_routing(routing)
        self.make_client = make_client
        self.routing = routing
        self.clients = [make_client(i) for i in range(size)]
        self.indexes = [_PrefixIndex() for _ in range(size)]
        self.restarting: set[int] = set()
        self._next = 0
        self._refuse_new = False
        self._closed = False
        self.on_dead: Callable[[str], None] | None = None
        self._on_step: Callable[[int], None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.info: p.Ready | None = None

    # ---- lifecycle ----------------------------------------------------------

    async def start(self) -> p.Ready:
        infos = await asyncio.gather(*(c.start() for c in self.clients))
        for i, client in enumerate(self.clients):
            self._watch(i, client)
        self.info = infos[0]
        return infos[0]

    def _watch(self, i: int, client: AsyncEngineClient) -> None:
        client.on_step = self._on_step
        client.on_dead = lambda message, i=i: self._replica_died(i, message)

    def _replica_died(self, i: int, message: str) -> None:
        if self._closed or self._refuse_new:
            return
        logger.error("replica %d died (%s); starting a new one", i, message)
        self.indexes[i] = _PrefixIndex()
        self.restarting.add(i)
        task = asyncio.get_running_loop().create_task(self._restart(i))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, i: int) -> None:
        old = self.clients[i]
        with contextlib.suppress(Exception):
            await old.shutdown(timeout=1.0)
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            if self._closed:
                return
            client = self.make_client(i)
            try:
                await client.start()
            except Exception as exc:
                logger.error("replica %d failed to restart (attempt %d): %s", i, attempt, exc)
                with contextlib.suppress(Exception):
                    await client.shutdown(timeout=1.0)
                continue
            self.clients[i] = client
            self._watch(i, client)
            self.restarting.discard(i)
            logger.info("replica %d is back", i)
            return
        self.restarting.discard(i)
        if self.is_dead and self.on_dead is not None:
            self.on_dead(self.dead_message)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients), return_exceptions=True)

    # ---- routing --------------------------------------------------------------

    def live(self) -> list[int]:
        return [i for i, c in enumerate(self.clients) if not c.is_dead and i not in self.restarting]

    def pick(self, prompt_token_ids: list[int]) -> AsyncEngineClient:
        live = self.live()
        if not live:
            raise EngineDeadError(self.dead_message or "no engine replica is running")
        if self.routing == "round_robin":
            i = live[self._next % len(live)]
            self._next += 1
            return self.clients[i]
        hashes = block_hashes(prompt_token_ids)
        load = {i: len(self.clients[i].streams) for i in live}
        # among the least busy, take turns (requests that arrive together)
        least = min(live, key=lambda i: (load[i], (i - self._next) % len(self.clients)))
        self._next += 1
        matched = {i: self.indexes[i].matched(hashes) for i in live}
        best = max(live, key=lambda i: (matched[i], -load[i]))
        i = least
        # A prefix counts when it is most of the prompt or long on its own (a
        # chat template's common preamble alone would pin every request).
        held = matched[best] >= ROUTE_MIN_BLOCKS or matched[best] >= ROUTE_MIN_SHARE * len(hashes)
        if held and matched[best] > 0:
            over = load[best] - load[least]
            if over < IMBALANCE_REQUESTS or load[best] < IMBALANCE_RATIO * max(load[least], 1):
                i = best
        self.indexes[i].add(hashes)
        return self.clients[i]

    # ---- what the server reads and sends, over every replica -----------------

    @property
    def is_dead(self) -> bool:
        return not self.live() and not self.restarting

    @property
    def dead_message(self) -> str:
        messages = [c.dead_message for c in self.clients if c.dead_message]
        return "; ".join(messages) or "every engine replica stopped"

    @property
    def is_stalled(self) -> bool:
        return any(self.clients[i].is_stalled for i in self.live())

    @property
    def last_message_at(self) -> float:
        return min((self.clients[i].last_message_at for i in self.live()), default=0.0)

    @property
    def refuse_new(self) -> bool:
        return self._refuse_new

    @refuse_new.setter
    def refuse_new(self, value: bool) -> None:
        self._refuse_new = value
        for client in self.clients:
            client.refuse_new = value

    @property
    def on_step(self) -> Callable[[int], None] | None:
        return self._on_step

    @on_step.setter
    def on_step(self, callback: Callable[[int], None] | None) -> None:
        self._on_step = callback
        for client in self.clients:
            client.on_step = callback

    @property
    def streams(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for client in self.clients:
            merged.update(client.streams)
        return merged

    def replica_stats(self) -> list[p.EngineStats]:
        return [c.stats for c in self.clients]

    def fail_all(self, error: Exception) -> int:
        return sum(c.fail_all(error) for c in self.clients)

    def abort(self, request_id: str) -> None:
        for client in self.clients:
            if request_id in client.streams:
                client.abort(request_id)

    def adapter_users(self, lora_name: str) -> int:
        return sum(c.adapter_users(lora_name) for c in self.clients)

    def unload_adapter(self, lora_name: str) -> None:
        for i in self.live():
            self.clients[i].unload_adapter(lora_name)

    def reset_prefix_cache(self) -> None:
        for i in self.live():
            self.clients[i].reset_prefix_cache()

    def start_profile(self) -> None:
        for i in self.live():
            self.clients[i].start_profile()

    def stop_profile(self) -> None:
        for i in self.live():
            self.clients[i].stop_profile()


def replica_pool(
    options: dict[str, Any], size: int, routing: str, stall_timeout: float
) -> ReplicaPool:
    """`size` replicas of the engine `options` describe, as Ray actors (Ray
    started here unless this process is already connected; RAY_ADDRESS
    names a cluster to join). A replica asks Ray for the GPUs its
    tensor-parallel size needs on CUDA, for one CPU otherwise."""
    check_routing(routing)
    ray = _ray()
    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS"),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    device = str(options.get("device") or "auto")
    gpus = ray.cluster_resources().get("GPU", 0) > 0 and device in ("auto", "cuda")
    tp = int(options.get("tensor_parallel_size") or 1)
    resources: dict[str, float] = {"num_gpus": tp} if gpus else {"num_cpus": 1}
    kind, need = ("GPU", tp) if gpus else ("CPU", 1)
    available = int(ray.cluster_resources().get(kind, 0))
    if size * need > available:
        raise InvalidArgumentError(
            f"data_parallel_size={size} needs {size * need} {kind}s (x{need} each); the Ray "
            f"cluster has {available}"
        )

    def make(i: int) -> AsyncEngineClient:
        return AsyncEngineClient(
            options,
            stall_timeout=stall_timeout,
            process=RayEngineProcess(resources, name=str(i)),
        )

    return ReplicaPool(make, size, routing)
