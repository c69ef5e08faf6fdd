"""An unexpected error while the engine handles one request ends the
requests it concerns and nothing else: adding, a step (sampling state,
sampling, logits), and inputs that do not decode. Errors that may have
corrupted shared state stay fatal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from ferrox import LLM, SamplingParams
from ferrox.common import errors
from ferrox.common import protocol as p
from ferrox.engine import core as engine_core
from ferrox.engine.core_process import EngineLoop, fatal_description
from ferrox.executor.executor import is_fatal
from ferrox.runner import sampler as sampler_module

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
POISON_SEED = 4242  # the sampler below fails on any step with a row of this seed


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["llama-gqa-tied"]), max_num_seqs=8, num_kv_blocks=128, block_size=4)


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
    engine.scheduler.check_integrity()


@pytest.fixture
def poisoned_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the sampling state fails for any step with a poisoned row."""
    real = engine_core.SamplingBatchBuilder.build

    def build(self: Any, seqs: list[Any], *args: Any, **kw: Any) -> Any:
        if any(s.params.seed == POISON_SEED for s in seqs):
            raise RuntimeError("sampling blew up")
        return real(self, seqs, *args, **kw)

    monkeypatch.setattr(engine_core.SamplingBatchBuilder, "build", build)


def poisoned(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=max_tokens)


def run_to_end(llm: LLM, tokens: dict[str, list[int]] | None = None) -> dict[str, str | None]:
    """Steps until idle: each request's finish reason, or "failed"."""
    engine = llm.engine
    finished: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        deltas, _ = engine.step()
        for d in deltas:
            if tokens is not None:
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason:
                finished[d.request_id] = d.finish_reason
        for rid, kind, message in engine.take_failures():
            assert kind == "RequestFailedError", message
            finished[rid] = "failed"
    return finished


def test_a_request_whose_sampling_fails_ends_alone(llm: LLM, poisoned_sampler: None) -> None:
    engine = llm.engine
    engine.add_request("bystander", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40))
    tokens: dict[str, list[int]] = {"bystander": []}
    for _ in range(3):  # the bystander is decoding before the poisoned one arrives
        for d in engine.step()[0]:
            tokens["bystander"] += d.token_ids
    engine.add_request("poisoned", [4, 5, 6, 7, 8], poisoned())
    engine.add_request("late", [2, 3], SamplingParams(temperature=0.7, seed=1, max_tokens=5))
    failures: list[tuple[str, str, str]] = []
    real_take = engine.take_failures

    def take() -> list[tuple[str, str, str]]:
        got = real_take()
        failures.extend(got)
        return got

    engine.take_failures = take  # type: ignore[method-assign]
    try:
        finished = run_to_end(llm, tokens)
    finally:
        del engine.take_failures
    assert finished == {"bystander": "length", "poisoned": "failed", "late": "length"}
    assert "sampling blew up" in failures[0][2]
    assert_idle(llm)
    # The bystander's tokens are those it gets alone.
    alone = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=40), False)
    assert list(alone[0].outputs[0].token_ids) == tokens["bystander"]


def test_an_unattributable_step_failure_ends_the_step_and_serving_goes_on(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the forward pass failed once")
        return real(*args, **kw)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [3, 2, 1], GREEDY)
    assert run_to_end(llm) == {"a": "failed", "b": "failed"}
    assert_idle(llm)
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6
    assert_idle(llm)


def test_llm_raises_the_failure_and_cleans_up(llm: LLM, poisoned_sampler: None) -> None:
    with pytest.raises(errors.RequestFailedError, match="sampling blew up"):
        llm.generate([[9, 8, 7]], poisoned(), use_tqdm=False)
    assert_idle(llm)
    assert len(llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_fatal_errors_are_not_swallowed(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, logits: Any, batch: Any) -> Any:
        raise errors.IntegrityError("the block table is inconsistent")

    monkeypatch.setattr(sampler_module.Sampler, "__call__", broken)
    doomed = LLM(str(tiny_models["llama-gqa-tied"]), num_kv_blocks=64, block_size=4)
    doomed.engine.add_request("r", [1, 2], GREEDY)
    with pytest.raises(errors.IntegrityError):
        doomed.engine.step()
    assert is_fatal(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_fatal(RuntimeError("sampling blew up"))


class RawFrame:
    def __init__(self, data: bytes) -> None:
        self.buffer = data


class FrameSocket:
    """Stands in for the engine's ZMQ sockets: frames in, frames out."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.sent: list[bytes] = []

    def recv(self, flags: int = 0, copy: bool = True) -> RawFrame:
        if not self.frames:
            raise zmq.Again
        return RawFrame(self.frames.pop(0))

    def send(self, data: bytes, *args: Any, **kw: Any) -> None:
        self.sent.append(bytes(data))


def test_engine_loop_fails_undecodable_and_unaddable_requests(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = p.AddRequest("fine", [1, 2, 3], GREEDY)
    # Valid msgpack whose params fail validation on decoding (n = 0).
    bad_params = msgspec.msgpack.encode(
        {"type": "add", "request_id": "bad", "prompt_token_ids": [1], "params": {"n": 0}}
    )
    inputs = FrameSocket([p.encoder.encode(good), bad_params, b"\xc1 not msgpack"])
    loop = EngineLoop(llm.engine, inputs, FrameSocket([]), parent=0)  # type: ignore[arg-type]
    loop._drain_inputs()
    assert [(f.request_id, f.error_type) for f in loop.failed] == [("bad", "InvalidArgumentError")]
    assert llm.engine.request_ids() == ["fine"]

    def explode(*args: Any, **kw: Any) -> None:
        raise OverflowError("out of range integral type conversion attempted")

    monkeypatch.setattr(llm.engine, "_submit", explode)
    loop.failed.clear()
    loop._handle(p.AddRequest("overflow", [1, 2], GREEDY))
    assert [(f.request_id, f.error_type) for f in loop.failed] == [
        ("overflow", "RequestFailedError")
    ]
    monkeypatch.undo()
    llm.engine.abort_request("fine")
    assert_idle(llm)


def test_a_native_panic_is_reported_as_such() -> None:
    class PanicException(BaseException):  # the name pyo3 gives a Rust panic
        pass

    assert "native core panicked" in fatal_description(PanicException("index out of bounds"))
    assert fatal_description(MemoryError("x")) == "MemoryError: x"
