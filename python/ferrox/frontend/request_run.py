"""One engine request as the frontend follows it: token deltas in, text and
logprob updates out, timings for metrics and the request log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ferrox.common import protocol as p
from ferrox.common.errors import EngineDeadError, RequestTimeoutError, error_class
from ferrox.common.lora import LoRARequest
from ferrox.common.multimodal import ImageInput
from ferrox.common.outputs import PositionLogprobs
from ferrox.common.sampling_params import SamplingParams
from ferrox.frontend.engine_client import AsyncEngineClient, RequestStream, StreamItem
from ferrox.frontend.output_processor import RequestState, SequenceOutput, SequenceUpdate

logger = logging.getLogger("ferrox.server")


@dataclass(frozen=True)
class FinishedRequest:
    """A finished request's figures, for the server's metrics."""

    finished_reason: str
    ttft: float | None
    itls: list[float]
    frontend_latencies: Sequence[float]
    e2e: float
    queue_time: float | None
    prompt_tokens: int
    generation_tokens: int
    prefill_time: float | None
    decode_time: float | None
    inference_time: float | None
    n: int
    max_tokens: int | None


class RequestObserver(Protocol):
    """Where finished requests' figures go (the server's Prometheus metrics)."""

    def observe_request(self, request: FinishedRequest) -> None: ...


class RequestRun:
    """A `RequestState` fed from the engine process through the client."""

    def __init__(
        self,
        client: AsyncEngineClient,
        tokenizer: Any,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        log_token_ids: bool = False,
        log_request: bool = True,
        max_log_len: int | None = None,
        stream: bool = True,
        deadline: float | None = None,
        failover: Callable[[list[int]], AsyncEngineClient] | None = None,
        lora_request: LoRARequest | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        """`stream`: the caller reads each update's text (else only the final
        text). `deadline`: the `time.monotonic()` by which the request must
        finish; past it, it is aborted with `RequestTimeoutError`.
        `failover`: another engine for the prompt (a replica pool's `pick`),
        for a request whose engine died before it produced anything."""
        self.client = client
        self.failover = failover
        self.deadline = deadline
        self.state = RequestState(
            request_id, None, prompt_token_ids, params, tokenizer, stream=stream
        )
        self.priority = priority
        self.lora_request = lora_request
        self.images = images  # the prompt's processed images
        self.log_token_ids = log_token_ids
        self.log_request = log_request
        self.max_log_len = max_log_len
        self.token_times: list[float] = []
        # Per token delta: engine sent the step -> the update was handed on.
        self.frontend_latencies: list[float] = []

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def seqs(self) -> list[SequenceOutput]:
        return self.state.seqs

    @property
    def prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        return self.state.prompt_logprobs

    @property
    def is_finished(self) -> bool:
        return self.state.is_finished

    @property
    def num_output_tokens(self) -> int:
        return self.state.num_output_tokens

    async def updates(self) -> AsyncIterator[SequenceUpdate]:
        """Yields each sequence update until every sequence finished; an
        unfinished request is aborted in the engine however this ends
        (client disconnect, error, cancellation)."""
        stream = self._add_to(self.client)
        started = False
        try:
            while not self.is_finished:
                item, sent_at = await self._next(stream)
                if isinstance(item, EngineDeadError) and not started:
                    moved = self._fail_over()
                    if moved is not None:
                        stream = moved
                        continue
                started = True
                update = self._apply(item)
                if update is not None:
                    yield update
                # The consumer resumed this generator, so it has handed the
                # update on (for a stream: written the SSE event).
                if sent_at and isinstance(item, p.SequenceDelta) and item.token_ids:
                    self.frontend_latencies.append(time.monotonic() - sent_at)
        finally:
            if self.is_finished:
                self.client.release(self.request_id)
            else:
                self.client.abort(self.request_id)

    def _fail_over(self) -> RequestStream | None:
        """The request sent again to another engine, if there is one."""
        if self.failover is None:
            return None
        try:
            other = self.failover(self.prompt_token_ids)
        except EngineDeadError:
            return None
        if other is self.client:
            return None
        logger.warning("%s: its engine replica died before it started; moved", self.request_id)
        self.client = other
        return self._add_to(other)

    def _add_to(self, client: AsyncEngineClient) -> RequestStream:
        return client.add_request(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            priority=self.priority,
            lora_request=self.lora_request,
            images=self.images,
        )

    async def _next(self, stream: RequestStream) -> tuple[StreamItem, float]:
        if self.deadline is None:
            return await stream.get()
        try:
            return await asyncio.wait_for(stream.get(), self.deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise RequestTimeoutError(
                f"the request did not finish within its time limit "
                f"({len(self.seqs[0].token_ids)} tokens generated); it was aborted"
            ) from None

    def _apply(self, item: object) -> SequenceUpdate | None:
        if isinstance(item, Exception):
            raise item
        if isinstance(item, p.RequestFailed):
            raise error_class(item.error_type)(item.message)
        if not isinstance(item, (p.SequenceDelta, p.PromptLogprobs)):
            raise TypeError(f"unexpected engine message {type(item).__name__}")
        update = self.state.apply(item)
        if update is None:
            return None
        if update.token_ids and update.index == 0:
            self.token_times.append(time.time())
        if update.stopped_here:
            self.client.stop_sequence(self.state.stop_message(update))
        return update

    def finish(self, metrics: RequestObserver) -> None:
        """Records metrics and the log line of a finished request."""
        end = time.time()
        reason = self.seqs[0].finish_reason or "abort"
        m = self.state.metrics()
        ttft, queue = m.time_to_first_token, m.time_in_queue
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]
        n_out = self.num_output_tokens
        figures = FinishedRequest(
            finished_reason=reason,
            ttft=ttft,
            itls=gaps,
            frontend_latencies=self.frontend_latencies,
            e2e=end - m.arrival_time,
            queue_time=queue,
            prompt_tokens=len(self.prompt_token_ids),
            generation_tokens=n_out,
            prefill_time=_elapsed(m.first_scheduled_time, m.first_token_time),
            decode_time=_elapsed(m.first_token_time, m.last_token_time),
            inference_time=_elapsed(m.first_scheduled_time, m.last_token_time),
            n=self.params.n,
            max_tokens=self.params.max_tokens,
        )
        metrics.observe_request(figures)
        if not self.log_request:
            return
        duration = max(end - (m.first_token_time or end), 1e-9)
        line = (
            f"{self.request_id}: prompt {len(self.prompt_token_ids)} tokens "
            f"({m.num_cached_tokens} cached), output {n_out} tokens, "
            f"ttft {ttft if ttft is not None else float('nan'):.3f} s, "
            f"{max(n_out - 1, 0) / duration:.1f} tok/s, finish {reason}"
        )
        if m.num_draft_tokens:
            line += (
                f", spec acceptance {m.num_accepted_tokens}/{m.num_draft_tokens} "
                f"({100 * m.num_accepted_tokens / m.num_draft_tokens:.0f}%)"
            )
        if self.log_token_ids:
            ids = self.prompt_token_ids
            if self.max_log_len is not None and len(ids) > self.max_log_len:
                shown = f"{ids[: self.max_log_len]} (+{len(ids) - self.max_log_len} more)"
            else:
                shown = str(ids)
            line += f", prompt ids {shown}, output ids {[s.token_ids for s in self.seqs]}"
        logger.info(line)


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


async def run_to_end(run: RequestRun) -> RequestRun:
    async for _ in run.updates():
        pass
    return run


async def merge(runs: list[RequestRun]) -> AsyncIterator[tuple[int, SequenceUpdate]]:
    """Interleaves the updates of several runs as they come: (run index, update).
    Cancelling the consumer cancels (and so aborts) every run."""
    if len(runs) == 1:  # the common case, without a task and a queue hop per token
        async with contextlib.aclosing(runs[0].updates()) as updates:  # type: ignore[type-var]
            async for update in updates:
                yield 0, update
        return
    queue: asyncio.Queue[tuple[int, SequenceUpdate | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, run: RequestRun) -> None:
        try:
            async for update in run.updates():
                queue.put_nowait((i, update))
            queue.put_nowait((i, None))
        except BaseException as e:
            queue.put_nowait((i, e))
            raise

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
