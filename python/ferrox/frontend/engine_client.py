"""AsyncEngineClient: the frontend's handle on the engine-core process.

It starts the process, sends requests over a ZMQ ipc socket and routes each
step's deltas to per-request queues. If the process dies, every waiting
request gets an `EngineDeadError` and `on_dead` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ferrox.engine import protocol as p
from ferrox.engine.core_process import run_engine_core
from ferrox.errors import EngineDeadError, ModelLoadError
from ferrox.sampling_params import SamplingParams

logger = logging.getLogger("ferrox.client")

StreamItem = p.SequenceDelta | p.PromptLogprobs | p.RequestFailed | Exception


class RequestStream:
    """What the engine reports for one request, in order, each item with the
    `time.monotonic()` at which the engine sent it (0.0 for local errors)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[tuple[StreamItem, float]] = asyncio.Queue()

    def put(self, item: StreamItem, sent_at: float = 0.0) -> None:
        self.queue.put_nowait((item, sent_at))

    async def get(self) -> tuple[StreamItem, float]:
        return await self.queue.get()


class AsyncEngineClient:
    def __init__(self, engine_options: dict[str, Any]) -> None:
        self.engine_options = engine_options
        self.streams: dict[str, RequestStream] = {}
        self.stats = p.EngineStats()
        self.info: p.Ready | None = None
        self.is_dead = False
        self.dead_message = ""
        self.on_dead: Callable[[str], None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._dir = tempfile.mkdtemp(prefix="ferrox-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)  # never drop or block
        self._from_engine.setsockopt(zmq.RCVHWM, 0)
        self._process: Any = None

    async def start(self, timeout: float = 900.0) -> p.Ready:
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        self._to_engine.bind(input_address)
        self._from_engine.bind(output_address)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=run_engine_core,
            args=(self.engine_options, input_address, output_address),
            name="ferrox-engine-core",
            daemon=True,
        )
        self._process.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._from_engine.poll(200):
                msg = p.output_decoder.decode(await self._from_engine.recv())
                if isinstance(msg, p.Ready):
                    self.info = msg
                    self._tasks = [
                        asyncio.create_task(self._read_outputs()),
                        asyncio.create_task(self._watch_process()),
                    ]
                    return msg
                if isinstance(msg, p.EngineDead):
                    raise ModelLoadError(f"the engine failed to start: {msg.message}")
            if not self._process.is_alive():
                raise ModelLoadError(
                    f"the engine process exited with code {self._process.exitcode} while loading"
                )
        raise ModelLoadError(f"the engine did not start within {timeout:.0f} s")

    # ---- requests ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> RequestStream:
        if self.is_dead:
            raise EngineDeadError(self.dead_message or "the engine process is not running")
        stream = RequestStream(request_id)
        self.streams[request_id] = stream
        message = p.AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            priority=priority,
        )
        self._send(message)
        return stream

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None and not self.is_dead:
            self._send(p.AbortRequests([request_id]))

    def release(self, request_id: str) -> None:
        """Forgets a finished request's stream."""
        self.streams.pop(request_id, None)

    def stop_sequence(self, stop: p.StopSequence) -> None:
        if not self.is_dead:
            self._send(p.StopSequences([stop]))

    def _send(self, message: p.EngineInput) -> None:
        # Without a high-water mark, PUSH queues instead of blocking.
        self._to_engine.send(p.encoder.encode(message), zmq.NOBLOCK)

    # ---- background tasks -------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            raw = await self._from_engine.recv()
            msg = p.output_decoder.decode(raw)
            if isinstance(msg, p.EngineDead):
                self._mark_dead(msg.message)
                return
            if not isinstance(msg, p.StepOutputs):
                continue
            self.stats = msg.stats
            items: list[p.RequestFailed | p.PromptLogprobs | p.SequenceDelta] = [
                *msg.failed,
                *msg.prompt_logprobs,
                *msg.deltas,
            ]
            for item in items:
                stream = self.streams.get(item.request_id)
                if stream is not None:
                    stream.put(item, msg.sent_at)

    async def _watch_process(self) -> None:
        while self._process.is_alive():
            await asyncio.sleep(0.2)
        if not self.is_dead:
            self._mark_dead(f"the engine process exited with code {self._process.exitcode}")

    def _mark_dead(self, message: str) -> None:
        if self.is_dead:
            return
        self.is_dead = True
        self.dead_message = message
        logger.error("engine core died: %s", message)
        for stream in self.streams.values():
            stream.put(EngineDeadError(message))
        if self.on_dead is not None:
            self.on_dead(message)

    async def shutdown(self, timeout: float = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._send(p.Shutdown())
            deadline = time.monotonic() + timeout
            while self._process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=5)
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid
