"""The one output path: the engine core's per-step token deltas become text,
stop-string finishes, decoded logprobs and `RequestOutput`s here, for the
offline `LLM` (in its own process) and for the server's frontend alike.

    engine step --SequenceDelta / PromptLogprobs--> RequestState.apply()
        -> SequenceUpdate (text delta, tokens, logprobs, finish)
        -> StopSequence for the engine when a stop string matched here
        -> RequestOutput (the whole request, or this step's delta)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from ferrox.common.protocol import PromptLogprobs, SequenceDelta, StopSequence, TokenLogprobs
from ferrox.common.sampling_params import SamplingParams
from ferrox.frontend.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class SequenceUpdate:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    # The engine should stop this sequence (a stop string matched here).
    stopped_here: bool = False


@dataclass
class SequenceOutput:
    """One of a request's `n` completions as the caller sees it.

    A sequence whose caller reads only the final text (`stream` False) and
    that has no stop strings is detokenized once, when it finishes: nothing
    in its text can change how it runs, so no token pays for it before.
    """

    index: int
    tokenizer: Any | None  # None: a model without a tokenizer (no text)
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = True  # the caller reads each update's text
    detokenizer: IncrementalDetokenizer | None = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None

    def __post_init__(self) -> None:
        self.detokenizer = None
        if self.tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(
                self.tokenizer, self.prompt_token_ids, self.params
            )
        self.deferred = is_final_only(self.stream, self.params)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer else ""

    def decode_token(self, token_id: int) -> str | None:
        return self.detokenizer.decode_token(token_id) if self.detokenizer else None

    def apply(self, delta: SequenceDelta) -> SequenceUpdate:
        """Consumes the engine's new tokens (ignored once finished); the
        update carries the new text only when streaming."""
        if self.finish_reason is not None:
            return SequenceUpdate(self.index, "", [], None, self.finish_reason, self.stop_reason)
        tokens = delta.token_ids
        # A deferred sequence only keeps its tokens until it finishes.
        detokenizer = None if self.deferred else self.detokenizer
        stopped_here = False
        if detokenizer is not None:
            # EOS / a stop token id that ends the sequence is counted, not shown.
            shown = tokens[:-1] if delta.finish_reason == "stop" else tokens
            for i, tok in enumerate(shown):
                stop = detokenizer.update((tok,))
                if stop is not None:
                    self.finish_reason, self.stop_reason = "stop", stop
                    tokens = tokens[: i + 1]
                    # Unless the engine ended it in this very delta, tell it to stop.
                    stopped_here = delta.finish_reason is None
                    break
        self.token_ids += tokens
        if self.finish_reason is None and delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason  # type: ignore[assignment]
            self.stop_reason = delta.stop_reason
            self._finish_text(delta.finish_reason == "stop")
        text = detokenizer.get_delta() if detokenizer is not None and self.stream else ""
        logprobs = None if delta.logprobs is None else self._logprobs(tokens, delta.logprobs)
        return SequenceUpdate(
            self.index, text, tokens, logprobs, self.finish_reason, self.stop_reason, stopped_here
        )

    def _finish_text(self, ends_on_stop_token: bool) -> None:
        if self.detokenizer is None:
            return
        if self.deferred:  # all the text at once
            self.detokenizer.update(self.token_ids[:-1] if ends_on_stop_token else self.token_ids)
        self.detokenizer.finish()

    def _logprobs(self, tokens: list[int], wire: TokenLogprobs) -> list[PositionLogprobs]:
        out = decode_logprobs(self.decode_token, tokens, wire)
        self.cumulative_logprob += sum(wire.logprobs[: len(tokens)])
        if self.logprobs is None:
            self.logprobs = []
        self.logprobs.extend(out)
        return out

    def completion(self, update: SequenceUpdate | None = None) -> CompletionOutput:
        """The whole completion so far, or (with `update`) what one step added."""
        if update is None:
            text, token_ids, logprobs = self.text, list(self.token_ids), self.logprobs
        else:
            text, token_ids, logprobs = update.text, update.token_ids, update.logprobs
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def is_final_only(stream: bool, params: SamplingParams) -> bool:
    """Nothing needs a sequence's tokens before it finishes: its caller reads
    only the final text, and it has no stop strings to match."""
    return not stream and not params.stop


def decode_logprobs(
    decode: Callable[[int], str | None], tokens: list[int], wire: TokenLogprobs
) -> list[PositionLogprobs]:
    """Logprob dicts for `tokens` (the chosen token first, then the top-k)."""
    out: list[PositionLogprobs] = []
    for j, tok in enumerate(tokens):
        entry: PositionLogprobs = {tok: Logprob(wire.logprobs[j], wire.ranks[j], decode(tok))}
        for rank, (tid, lp) in enumerate(zip(wire.top_ids[j], wire.top_logprobs[j], strict=True)):
            entry.setdefault(tid, Logprob(lp, rank + 1, decode(tid)))
        out.append(entry)
    return out


@dataclass
class RequestState:
    """A request as its caller follows it: `n` sequence outputs, the prompt
    logprobs, and the timings its metrics are made of."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Any | None
    arrival_time: float = field(default_factory=time.time)
    stream: bool = False
    seqs: list[SequenceOutput] = field(init=False)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # ... and kept
    embedding: list[float] | None = None  # an embedding request's pooled state

    def __post_init__(self) -> None:
        if self.tokenizer is None and self.params.stop:
            raise InvalidArgumentError("stop strings need a tokenizer; this model has none")
        self.seqs = [
            SequenceOutput(i, self.tokenizer, self.prompt_token_ids, self.params, self.stream)
            for i in range(self.params.n)
        ]
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def final_only(self) -> bool:
        return is_final_only(self.stream, self.params)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def apply(self, item: SequenceDelta | PromptLogprobs) -> SequenceUpdate | None:
        """Takes one item of an engine step; a sequence's update, if it was one."""
        if isinstance(item, PromptLogprobs):
            if self.prompt_logprobs is not None:
                tokens = self.prompt_token_ids[item.start : item.start + len(item.logprobs.ranks)]
                self.prompt_logprobs += decode_logprobs(
                    self.seqs[0].decode_token, tokens, item.logprobs
                )
            return None
        now = time.time()
        if item.first_scheduled_time is not None and self.first_scheduled_time is None:
            self.first_scheduled_time = item.first_scheduled_time
        if item.num_cached_tokens is not None and item.index == 0:
            self.num_cached_tokens = item.num_cached_tokens
        if item.num_preemptions:
            self.num_preemptions += item.num_preemptions
        if item.num_draft_tokens:
            self.num_draft_tokens += item.num_draft_tokens
            self.num_accepted_tokens += item.num_accepted_tokens
        if item.embedding is not None:
            self.embedding = item.embedding
        if item.token_ids:
            if self.first_token_time is None:
                self.first_token_time = item.first_token_time or now
            self.last_token_time = now
        return self.seqs[item.index].apply(item)

    def stop_message(self, update: SequenceUpdate) -> StopSequence:
        """What tells the engine that a stop string ended a sequence here."""
        seq = self.seqs[update.index]
        return StopSequence(self.request_id, update.index, len(seq.token_ids))

    def output(self, updates: list[SequenceUpdate] | None = None) -> RequestOutput:
        """The whole request, or (with `updates`) what one step added to it."""
        if updates is None:
            completions = [s.completion() for s in self.seqs]
        else:
            completions = [self.seqs[u.index].completion(u) for u in updates]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=completions,
            finished=self.is_finished,
            metrics=self.metrics(),
            embedding=self.embedding,
        )

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=self.last_token_time if self.is_finished else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            num_generation_tokens=self.num_output_tokens,
            num_preemptions=self.num_preemptions,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )


class OutputProcessor:
    """The requests of an in-process engine (the offline `LLM`)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        stream: bool = False,
    ) -> RequestState:
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            self.tokenizer,
            arrival_time=arrival_time or time.time(),
            stream=stream,
        )
        self.requests[request_id] = state
        return state

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(
        self, deltas: list[SequenceDelta], prompt_logprobs: list[PromptLogprobs]
    ) -> tuple[list[RequestOutput], list[StopSequence]]:
        """One engine step: the outputs to hand back (finished requests, and
        each streaming request's delta) and the sequences to stop."""
        for item in prompt_logprobs:
            if (state := self.requests.get(item.request_id)) is not None:
                state.apply(item)
        stops: list[StopSequence] = []
        progressed: dict[str, list[SequenceUpdate]] = {}
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue
            update = state.apply(delta)
            if update is None:
                continue
            progressed.setdefault(delta.request_id, []).append(update)
            if update.stopped_here:
                stops.append(state.stop_message(update))
        outputs = []
        for request_id, updates in progressed.items():
            state = self.requests[request_id]
            # Only a sequence that finished in this step can finish its request.
            finished = any(u.finish_reason for u in updates) and state.is_finished
            if finished:
                del self.requests[request_id]
            if state.stream:
                outputs.append(state.output(updates))
            elif finished:
                outputs.append(state.output())
        return outputs, stops
