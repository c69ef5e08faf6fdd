"""AsyncEngineClient: the frontend's handle on the engine-core process.

It starts the process, sends requests over a ZMQ ipc socket and routes each
step's deltas to per-request queues. If the process dies, or the task that
reads its outputs fails, every waiting request gets an `EngineDeadError` and
`on_dead` is called.

Liveness: the engine sends at least one message per heartbeat interval, busy
or idle. When none has arrived for `stall_timeout` seconds the engine counts
as stalled (`is_stalled`: /health answers 503, a log line says why) until
the next message arrives.

Both sockets have high-water marks: a request that would pass the frontend's
bound fails at once with `ServerBusyError`, and an engine that outruns the
frontend waits instead of growing its queue without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ferrox.common import protocol as p
from ferrox.common.errors import (
    EngineDeadError,
    InvalidArgumentError,
    ModelLoadError,
    ServerBusyError,
)
from ferrox.common.lora import LoRARequest
from ferrox.common.multimodal import ImageInput
from ferrox.common.sampling_params import SamplingParams

logger = logging.getLogger("ferrox.client")
DEFAULT_STALL_TIMEOUT_S = 60.0


# The engine process's entry function, named by module path: the frontend
# imports no engine code (torch, the model code); the child process does.
ENGINE_ENTRY = "ferrox.engine.core_process:run_engine_core"


def engine_process_main(options: dict[str, Any], input_address: str, output_address: str) -> None:
    """The engine process's entry point (a local child or a Ray actor): runs
    ENGINE_ENTRY."""
    module, _, function = ENGINE_ENTRY.partition(":")
    run_engine_core = getattr(importlib.import_module(module), function)
    run_engine_core(options, input_address, output_address)


# What the engine process runs: its arguments come msgpack-encoded on
# standard input. A fresh interpreter, not multiprocessing's spawn, so that
# the caller's main module is never imported again in the child (a script
# without a main guard, or one read from standard input, would otherwise
# start a second engine or fail to load).
_CHILD_MAIN = (
    "import sys, msgspec\n"
    "path, *args = msgspec.msgpack.decode(sys.stdin.buffer.read())\n"
    "sys.path[:] = path\n"
    "from ferrox.frontend.engine_client import engine_process_main\n"
    "engine_process_main(*args)\n"
)


def _plain(value: Any) -> Any:
    """Engine options msgpack does not know: paths become their text."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"an engine option of type {type(value).__name__} cannot reach the engine")


class LocalEngineProcess:
    """The engine-core process on this machine (a child interpreter),
    reached over ipc:// sockets in a private temporary directory. It ends
    itself when this process is gone."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ferrox-ipc-")
        self._process: subprocess.Popen[bytes] | None = None

    def bind(self, to_engine: zmq.Socket, from_engine: zmq.Socket) -> tuple[str, str]:
        """Binds the client's sockets; the addresses the engine connects to."""
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        to_engine.bind(input_address)
        from_engine.bind(output_address)
        return input_address, output_address

    def start(self, options: dict[str, Any], input_address: str, output_address: str) -> None:
        try:
            payload = msgspec.msgpack.encode(
                [list(sys.path), options, input_address, output_address], enc_hook=_plain
            )
        except TypeError as e:
            raise InvalidArgumentError(str(e)) from None
        process = subprocess.Popen([sys.executable, "-c", _CHILD_MAIN], stdin=subprocess.PIPE)
        assert process.stdin is not None
        try:
            process.stdin.write(payload)
            process.stdin.close()
        except OSError:  # it died at once; is_alive and exit_description say so
            pass
        self._process = process

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def exit_description(self) -> str:
        code = None if self._process is None else self._process.poll()
        return f"the engine process exited with code {code}"

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()

    def join(self, timeout: float) -> None:
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=timeout)

    def cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid


StreamItem = p.SequenceDelta | p.PromptLogprobs | p.RequestFailed | Exception


class RequestStream:
    """What the engine reports for one request, in order, each item with the
    `time.monotonic()` at which the engine sent it (0.0 for local errors)."""

    def __init__(self, request_id: str, lora_name: str | None = None) -> None:
        self.request_id = request_id
        self.lora_name = lora_name  # the LoRA adapter it runs under
        self.queue: asyncio.Queue[tuple[StreamItem, float]] = asyncio.Queue()

    def put(self, item: StreamItem, sent_at: float = 0.0) -> None:
        self.queue.put_nowait((item, sent_at))

    async def get(self) -> tuple[StreamItem, float]:
        return await self.queue.get()


class AsyncEngineClient:
    def __init__(
        self,
        engine_options: dict[str, Any],
        *,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        process: Any = None,
    ) -> None:
        """`process`: where the engine runs (LocalEngineProcess by default;
        see frontend/replicas.py for a Ray actor)."""
        self.engine_options = engine_options
        self.process = process if process is not None else LocalEngineProcess()
        self.stall_timeout = stall_timeout
        self.last_message_at = time.monotonic()
        self.is_stalled = False
        self.refuse_new = False  # set once the server has ended its last requests
        self.streams: dict[str, RequestStream] = {}
        self.stats = p.EngineStats()
        self.info: p.Ready | None = None
        self.is_dead = False
        self.dead_message = ""
        self.on_dead: Callable[[str], None] | None = None
        self.on_step: Callable[[int], None] | None = None  # tokens of each engine step
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._to_engine.setsockopt(zmq.SNDHWM, p.INPUT_HWM)
        self._from_engine.setsockopt(zmq.RCVHWM, p.OUTPUT_HWM)

    async def start(self, timeout: float = 900.0) -> p.Ready:
        addresses = self.process.bind(self._to_engine, self._from_engine)
        self.process.start(self.engine_options, *addresses)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._from_engine.poll(200):
                msg = p.output_decoder.decode(await self._from_engine.recv())
                if isinstance(msg, p.Ready):
                    self.info = msg
                    self.last_message_at = time.monotonic()
                    self._tasks = [
                        asyncio.create_task(self._read_outputs()),
                        asyncio.create_task(self._watch_process()),
                    ]
                    return msg
                if isinstance(msg, p.EngineDead):
                    raise ModelLoadError(f"the engine failed to start: {msg.message}")
            if not self.process.is_alive():
                raise ModelLoadError(f"{self.process.exit_description()} while loading")
        raise ModelLoadError(f"the engine did not start within {timeout:.0f} s")

    # ---- requests ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        images: list[ImageInput] | None = None,
    ) -> RequestStream:
        if self.is_dead:
            raise EngineDeadError(self.dead_message or "the engine process is not running")
        if self.refuse_new:
            raise ServerBusyError("the server is shutting down", 5)
        stream = RequestStream(request_id, lora_request.lora_name if lora_request else None)
        self.streams[request_id] = stream
        message = p.AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            priority=priority,
            lora=lora_request,
            images=images,
        )
        self._send(message)
        return stream

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None and not self.is_dead:
            self._send(p.AbortRequests([request_id]))

    def release(self, request_id: str) -> None:
        """Forgets a finished request's stream."""
        self.streams.pop(request_id, None)

    def adapter_users(self, lora_name: str) -> int:
        """Requests in flight under the LoRA adapter."""
        return sum(s.lora_name == lora_name for s in self.streams.values())

    def unload_adapter(self, lora_name: str) -> None:
        if not self.is_dead:
            self._control(p.UnloadAdapter(lora_name))

    def stop_sequence(self, stop: p.StopSequence) -> None:
        if not self.is_dead:
            self._send(p.StopSequences([stop]))

    def _send(self, message: p.EngineInput) -> None:
        try:
            self._to_engine.send(p.encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            if isinstance(message, p.AddRequest):
                self.streams.pop(message.request_id, None)
            raise ServerBusyError("the engine's input queue is full; retry later") from None

    # ---- background tasks -------------------------------------------------

    async def _read_outputs(self) -> None:
        try:
            while True:
                msg = p.output_decoder.decode(await self._from_engine.recv())
                self._heard_from_engine()
                if isinstance(msg, p.EngineDead):
                    self._mark_dead(msg.message)
                    return
                if isinstance(msg, p.StepOutputs):
                    self._route(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # nothing would reach any request again
            logger.exception("the engine output reader failed")
            self._mark_dead(f"the engine output reader failed: {type(e).__name__}: {e}")

    def _heard_from_engine(self) -> None:
        self.last_message_at = time.monotonic()
        if self.is_stalled:
            self.is_stalled = False
            logger.warning("the engine is making progress again")

    def _route(self, msg: p.StepOutputs) -> None:
        self.stats = msg.stats
        if msg.step_tokens and self.on_step is not None:
            self.on_step(msg.step_tokens)
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
        while self.process.is_alive():
            await asyncio.sleep(0.2)
            silent = time.monotonic() - self.last_message_at
            if not self.is_stalled and silent > self.stall_timeout:
                self.is_stalled = True
                logger.error(
                    "the engine sent nothing for %.0f s (it heartbeats every %.0f s) with %d "
                    "requests in flight: it is stuck or stopped; /health answers 503",
                    silent,
                    p.HEARTBEAT_S,
                    len(self.streams),
                )
        if not self.is_dead:
            self._mark_dead(self.process.exit_description())

    def reset_prefix_cache(self) -> None:
        self._control(p.ResetPrefixCache())

    def start_profile(self) -> None:
        self._control(p.StartProfile())

    def stop_profile(self) -> None:
        self._control(p.StopProfile())

    def _control(self, message: p.EngineInput) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_message or "the engine process is not running")
        self._send(message)

    def fail_all(self, error: Exception) -> int:
        """Ends every request in flight with `error` (each is then aborted
        in the engine by its reader); returns how many there were."""
        streams = list(self.streams.values())
        for stream in streams:
            stream.put(error)
        return len(streams)

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
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError, ServerBusyError):
                self._send(p.Shutdown())
            deadline = time.monotonic() + timeout
            while self.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.process.is_alive():
                self.process.kill()
            self.process.join(timeout=5)
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        self.process.cleanup()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    # ---- the interface a pool of replicas shares (frontend/replicas.py) ----

    def pick(self, prompt_token_ids: list[int]) -> AsyncEngineClient:
        """The client a request goes to: this one."""
        return self

    def replica_stats(self) -> list[p.EngineStats]:
        return [self.stats]
