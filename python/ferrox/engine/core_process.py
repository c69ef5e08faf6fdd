"""The engine-core process: the EngineCore step loop behind two ZMQ ipc
sockets. Inputs (add / abort / stop / shutdown) arrive as msgpack; each
step's token deltas and stats go back the same way. When idle, the loop
checks the scheduler's invariants (at most once every few seconds)."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

import msgspec
import zmq

from ferrox._native import SchedulerStats
from ferrox.common import protocol as p
from ferrox.common.config import EngineConfig
from ferrox.common.errors import FerroxError
from ferrox.common.runtime import freeze_long_lived_objects, thaw_long_lived_objects
from ferrox.engine.core import EngineCore
from ferrox.engine.multimodal import image_prompt
from ferrox.parallel.device import torch_device, torch_dtype

logger = logging.getLogger("ferrox.engine")
IDLE_POLL_MS = 50
INTEGRITY_CHECK_INTERVAL_S = 5.0


class _AnyRequest(msgspec.Struct):
    """What every request-bearing input has, for reporting one that fails to decode."""

    request_id: str


def run_engine_core(options: dict[str, Any], input_address: str, output_address: str) -> None:
    """Process entry point: load, announce readiness, serve until shut down."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, p.OUTPUT_HWM)  # a stalled frontend makes the engine wait
    outputs.connect(output_address)
    parent = os.getppid()
    # Shutdown is the frontend's to decide: Ctrl-C or a SIGTERM sent to the
    # whole process group must not end the engine under in-flight requests
    # (it still exits when the frontend is gone or tells it to).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = EngineCore(EngineConfig.create(**options))
        # This process serves this one engine until it ends: its objects
        # and the libraries' stay out of the collector's full scans.
        freeze_long_lived_objects()
        outputs.send(
            p.encoder.encode(
                p.Ready(
                    model=engine.loaded.source,
                    max_model_len=engine.max_model_len,
                    vocab_size=engine.vocab_size,
                    num_kv_blocks=engine.runner.num_kv_blocks,
                    block_size=engine.config.block_size,
                    load_seconds=engine.loaded.load_seconds,
                    device=str(torch_device(engine.config)),
                    dtype=str(torch_dtype(engine.config)).removeprefix("torch."),
                    kv_dtype=str(engine.runner.kv_dtype).removeprefix("torch."),
                    labels=engine.runner.model.labels,
                    image_prompt=image_prompt(engine.runner.model),
                    **lora_targets(engine),
                )
            )
        )
        EngineLoop(engine, inputs, outputs, parent).run()
        engine.close()
        thaw_long_lived_objects()
    except BaseException as e:  # a panic in the native core is a BaseException
        logger.critical("engine core failed: %s\n%s", fatal_description(e), traceback.format_exc())
        outputs.send(p.encoder.encode(p.EngineDead(message=fatal_description(e))))
        time.sleep(0.2)  # let the message leave before the process ends
        os._exit(1)
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)
        ctx.term()


def fatal_description(exc: BaseException) -> str:
    """What the frontend and the log say about an error that ends the engine."""
    if type(exc).__name__ == "PanicException":  # pyo3's: a Rust panic
        return f"the native core panicked (a bug in ferrox; please report it): {exc}"
    return f"{type(exc).__name__}: {exc}"


class EngineLoop:
    def __init__(self, engine: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent: int):
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent = parent
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.failed: list[p.RequestFailed] = []
        self.stopping = False
        self.integrity_failures = 0
        self.last_integrity_check = 0.0

    def run(self) -> None:
        last_stats: p.EngineStats | None = None
        last_sent = 0.0
        engine = self.engine
        while not self.stopping:
            busy = engine.has_unfinished_requests()
            if self.poller.poll(0 if busy else IDLE_POLL_MS):
                self._drain_inputs()
            if os.getppid() != self.parent:
                logger.warning("the frontend process is gone; stopping")
                return
            deltas: list[p.SequenceDelta] = []
            prompt: list[p.PromptLogprobs] = []
            step_tokens = 0
            if engine.has_unfinished_requests():
                deltas, prompt = engine.step()
                step_tokens = engine.last_step_tokens
                self.failed += [p.RequestFailed(*f) for f in engine.take_failures()]
                stats = self._stats(engine.latest_stats)
            else:
                self._check_integrity_when_due()
                stats = self._stats(engine.stats())
            t = time.monotonic()
            heartbeat = t - last_sent >= p.HEARTBEAT_S
            if deltas or prompt or self.failed or stats != last_stats or heartbeat:
                message = p.StepOutputs(deltas, prompt, self.failed, stats, t, step_tokens)
                if not self._send(p.encoder.encode(message)):
                    return
                self.failed = []
                last_stats, last_sent = stats, t

    def _send(self, data: bytes) -> bool:
        """Sends one message, waiting while the frontend's queue is full;
        False when the frontend is gone meanwhile."""
        while True:
            try:
                self.outputs.send(data, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if os.getppid() != self.parent:
                    logger.warning("the frontend process is gone; stopping")
                    return False
                time.sleep(0.01)

    def _drain_inputs(self) -> None:
        while True:
            try:
                raw = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = p.input_decoder.decode(raw.buffer)
            except msgspec.DecodeError as e:  # ValidationError included
                self._reject(bytes(raw.buffer), e)
                continue
            self._handle(msg)

    def _reject(self, raw: bytes, exc: Exception) -> None:
        """An input that does not decode fails its request, if it names one."""
        try:
            rid = msgspec.msgpack.decode(raw, type=_AnyRequest).request_id
        except msgspec.DecodeError:
            logger.error("dropped an engine input that does not decode: %s", exc)
            return
        self.failed.append(p.RequestFailed(rid, "InvalidArgumentError", str(exc)))

    def _handle(self, msg: p.EngineInput) -> None:
        engine = self.engine
        if isinstance(msg, p.AddRequest):
            try:
                engine.add_request(
                    msg.request_id,
                    msg.prompt_token_ids,
                    msg.params,
                    priority=msg.priority,
                    lora_request=msg.lora,
                    images=msg.images,
                )
            except FerroxError as e:
                self.failed.append(p.RequestFailed(msg.request_id, type(e).__name__, str(e)))
            except Exception as e:  # adding failed unexpectedly: this request only
                if engine.executor.is_fatal(e):
                    raise
                logger.error("adding %s failed:\n%s", msg.request_id, traceback.format_exc())
                message = f"adding the request failed: {type(e).__name__}: {e}"
                self.failed.append(p.RequestFailed(msg.request_id, "RequestFailedError", message))
        elif isinstance(msg, p.AbortRequests):
            for rid in msg.request_ids:
                engine.abort_request(rid)
        elif isinstance(msg, p.StopSequences):
            for stop in msg.sequences:
                engine.stop_sequence(stop.request_id, stop.index, stop.num_output_tokens)
        elif isinstance(msg, (p.StartProfile, p.StopProfile)):
            try:
                if isinstance(msg, p.StartProfile):
                    engine.start_profile()
                else:
                    engine.stop_profile()
            except Exception as e:  # a control message never stops the engine
                if engine.executor.is_fatal(e):
                    raise
                logger.error("%s: %s", type(msg).__name__, e)
        elif isinstance(msg, p.UnloadAdapter):
            try:
                if engine.adapters is not None and engine.adapters.unload(msg.lora_name):
                    logger.info("LoRA adapter %r unloaded", msg.lora_name)
            except FerroxError as e:  # still in use: it goes once idle, as any other
                logger.warning("unloading LoRA adapter %r: %s", msg.lora_name, e)
        elif isinstance(msg, p.ResetPrefixCache):
            freed = engine.reset_prefix_cache()
            logger.info("prefix cache reset: %d blocks freed", freed)
        elif isinstance(msg, p.Shutdown):
            for rid in engine.request_ids():
                engine.abort_request(rid)
            self.stopping = True

    def _check_integrity_when_due(self) -> None:
        """Idle, so the check costs no request anything; rate limited all the same."""
        t = time.monotonic()
        if t - self.last_integrity_check < INTEGRITY_CHECK_INTERVAL_S:
            return
        self.last_integrity_check = t
        try:
            self.engine.scheduler.check_integrity()
        except FerroxError:
            self.integrity_failures += 1
            logger.error(
                "SCHEDULER INTEGRITY CHECK FAILED (a bug in ferrox; please report it):\n%s",
                traceback.format_exc(),
            )

    def _stats(self, s: SchedulerStats) -> p.EngineStats:
        return p.EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_total_blocks=s.num_total_blocks,
            num_used_blocks=s.num_used_blocks,
            num_cached_blocks=s.num_cached_blocks,
            num_window_blocks=s.num_window_blocks,
            num_free_window_blocks=s.num_free_window_blocks,
            prefix_queried_tokens=s.prefix_queried_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            spec_num_drafts=s.spec_num_drafts,
            spec_num_draft_tokens=s.spec_num_draft_tokens,
            spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            spec_accepted_lengths=s.spec_accepted_lengths,
            spec_accepted_per_position=s.spec_accepted_per_position,
            prompt_tokens=self.engine.num_prompt_tokens,
            generation_tokens=self.engine.num_generated_tokens,
            integrity_failures=self.integrity_failures,
        )


def lora_targets(engine: EngineCore) -> dict[str, Any]:
    """The Ready message's fields that let the frontend check an adapter."""
    lora = engine.runner.lora
    if lora is None:
        return {}
    modules = {name: list(shape) for name, shape in lora.targets.modules.items()}
    return {"lora_layers": lora.targets.num_layers, "lora_modules": modules}
