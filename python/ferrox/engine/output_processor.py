"""Frontend side of a sequence: turns the engine's token deltas into text
deltas, matches stop strings, and decodes logprob tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ferrox.engine.detokenizer import IncrementalDetokenizer
from ferrox.engine.protocol import SequenceDelta, TokenLogprobs
from ferrox.outputs import FinishReason, Logprob, PositionLogprobs
from ferrox.sampling_params import SamplingParams


@dataclass
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
    index: int
    tokenizer: Any
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(
            self.tokenizer, self.prompt_token_ids, self.params
        )

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.output_text

    def apply(self, delta: SequenceDelta) -> SequenceUpdate:
        """Consumes the engine's new tokens (ignored once finished)."""
        if self.is_finished:
            return SequenceUpdate(self.index, "", [], None, self.finish_reason, self.stop_reason)
        tokens = delta.token_ids
        ends_on_stop_token = delta.finish_reason == "stop"
        taken: list[int] = []
        stopped_here = False
        for i, tok in enumerate(tokens):
            taken.append(tok)
            if ends_on_stop_token and i == len(tokens) - 1:
                break  # EOS / a stop token id: counted, not shown
            stop = self.detokenizer.update([tok])
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                # Unless the engine ended it in this very delta, tell it to stop.
                stopped_here = delta.finish_reason is None
                break
        self.token_ids += taken
        if self.finish_reason is None and delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason  # type: ignore[assignment]
            self.stop_reason = delta.stop_reason
            self.detokenizer.finish()
        text = self.detokenizer.get_delta()
        logprobs = self._logprobs(taken, delta.logprobs)
        return SequenceUpdate(
            self.index, text, taken, logprobs, self.finish_reason, self.stop_reason, stopped_here
        )

    def _logprobs(
        self, tokens: list[int], wire: TokenLogprobs | None
    ) -> list[PositionLogprobs] | None:
        if wire is None:
            return None
        decode = self.detokenizer.decode_token
        out: list[PositionLogprobs] = []
        for j, tok in enumerate(tokens):
            lp = wire.logprobs[j]
            self.cumulative_logprob += lp
            entry: PositionLogprobs = {tok: Logprob(lp, wire.ranks[j], decode(tok))}
            for rank, (tid, tlp) in enumerate(
                zip(wire.top_ids[j], wire.top_logprobs[j], strict=True)
            ):
                if tid not in entry:
                    entry[tid] = Logprob(tlp, rank + 1, decode(tid))
            out.append(entry)
        self.logprobs = (self.logprobs or []) + out
        return out


def decode_prompt_logprobs(
    tokenizer_decode: Any, prompt_token_ids: list[int], start: int, wire: TokenLogprobs
) -> list[PositionLogprobs]:
    """Prompt logprobs of positions [start, start + n) as Logprob dicts."""
    out: list[PositionLogprobs] = []
    for j, lp in enumerate(wire.logprobs):
        tok = prompt_token_ids[start + j]
        entry: PositionLogprobs = {tok: Logprob(lp, wire.ranks[j], tokenizer_decode(tok))}
        for rank, (tid, tlp) in enumerate(zip(wire.top_ids[j], wire.top_logprobs[j], strict=True)):
            entry.setdefault(tid, Logprob(tlp, rank + 1, tokenizer_decode(tid)))
        out.append(entry)
    return out
