"""One engine request as the frontend follows it: token deltas in, text and
logprob updates out, timings for metrics and the request log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ferrox.engine import protocol as p
from ferrox.engine.client import AsyncEngineClient
from ferrox.engine.output_processor import (
    SequenceOutput,
    SequenceUpdate,
    decode_prompt_logprobs,
)
from ferrox.errors import EngineDeadError, InvalidArgumentError
from ferrox.outputs import PositionLogprobs
from ferrox.sampling_params import SamplingParams
from ferrox.server.metrics import Metrics

logger = logging.getLogger("ferrox.server")


@dataclass
class RequestRun:
    client: AsyncEngineClient
    tokenizer: Any
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    log_token_ids: bool = False
    arrival: float = field(default_factory=time.time)
    seqs: list[SequenceOutput] = field(init=False)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    # Per token delta: engine sent the step -> the update was handed on.
    frontend_latencies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seqs = [
            SequenceOutput(i, self.tokenizer, self.prompt_token_ids, self.params)
            for i in range(self.params.n)
        ]
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    async def updates(self) -> AsyncIterator[SequenceUpdate]:
        """Yields each sequence update until every sequence finished; an
        unfinished request is aborted in the engine however this ends
        (client disconnect, error, cancellation)."""
        stream = self.client.add_request(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            arrival_time=self.arrival,
            priority=self.priority,
        )
        try:
            while not self.is_finished:
                item, sent_at = await stream.get()
                for update in self._apply(item):
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

    def _apply(self, item: object) -> list[SequenceUpdate]:
        if isinstance(item, EngineDeadError):
            raise item
        if isinstance(item, Exception):
            raise item
        if isinstance(item, p.RequestFailed):
            raise InvalidArgumentError(item.message)
        if isinstance(item, p.PromptLogprobs):
            if self.prompt_logprobs is not None:
                decode = self.seqs[0].detokenizer.decode_token
                self.prompt_logprobs += decode_prompt_logprobs(
                    decode, self.prompt_token_ids, item.start, item.logprobs
                )
            return []
        assert isinstance(item, p.SequenceDelta)
        now = time.time()
        if item.first_scheduled_time is not None and self.first_scheduled_time is None:
            self.first_scheduled_time = item.first_scheduled_time
        if item.num_cached_tokens is not None and item.index == 0:
            self.num_cached_tokens = item.num_cached_tokens
        if item.token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            if item.index == 0:
                self.token_times.append(now)
        update = self.seqs[item.index].apply(item)
        if update.stopped_here:
            self.client.finish_sequence(self.request_id, item.index)
        return [update]

    def finish(self, metrics: Metrics) -> None:
        """Records metrics and the log line of a finished request."""
        end = time.time()
        reason = self.seqs[0].finish_reason or "abort"
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]
        queue = (
            None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival
        )
        n_out = self.num_output_tokens
        metrics.observe_request(
            finished_reason=reason,
            ttft=ttft,
            itls=gaps,
            frontend_latencies=self.frontend_latencies,
            e2e=end - self.arrival,
            queue_time=queue,
            prompt_tokens=len(self.prompt_token_ids),
            generation_tokens=n_out,
        )
        duration = max(end - (self.first_token_time or end), 1e-9)
        line = (
            f"{self.request_id}: prompt {len(self.prompt_token_ids)} tokens "
            f"({self.num_cached_tokens} cached), output {n_out} tokens, "
            f"ttft {ttft if ttft is not None else float('nan'):.3f} s, "
            f"{max(n_out - 1, 0) / duration:.1f} tok/s, finish {reason}"
        )
        if self.log_token_ids:
            line += f", prompt ids {self.prompt_token_ids}, output ids "
            line += str([s.token_ids for s in self.seqs])
        logger.info(line)


async def run_to_end(run: RequestRun) -> RequestRun:
    async for _ in run.updates():
        pass
    return run


async def merge(runs: list[RequestRun]) -> AsyncIterator[tuple[int, SequenceUpdate]]:
    """Interleaves the updates of several runs as they come: (run index, update).
    Cancelling the consumer cancels (and so aborts) every run."""
    if len(runs) == 1:  # the common case, without a task and a queue hop per token
        async with contextlib.aclosing(runs[0].updates()) as updates:
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
