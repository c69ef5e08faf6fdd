"""Messages between the frontend and the engine-core process: msgspec
structs sent as msgpack over ZMQ (never pickle)."""

from __future__ import annotations

import msgspec

from ferrox.sampling_params import SamplingParams


class WireSamplingParams(msgspec.Struct, omit_defaults=True):
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None

    @classmethod
    def from_params(cls, p: SamplingParams) -> WireSamplingParams:
        # Stop strings and detokenization options stay in the frontend.
        return cls(
            n=p.n,
            max_tokens=p.max_tokens,
            min_tokens=p.min_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            seed=p.seed,
            stop_token_ids=list(p.stop_token_ids or []),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs,
            logit_bias=dict(p.logit_bias) if p.logit_bias else None,
        )

    def to_params(self) -> SamplingParams:
        return SamplingParams(**{f: getattr(self, f) for f in self.__struct_fields__})


# ---- frontend -> engine ------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    arrival_time: float
    priority: int = 0


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class FinishSequences(msgspec.Struct, tag="finish"):
    """Sequences the frontend ended (a stop string matched): (request id, index)."""

    sequences: list[tuple[str, int]]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequest | AbortRequests | FinishSequences | Shutdown


# ---- engine -> frontend ------------------------------------------------------


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Per new token: its logprob and rank, and the top-k ids / logprobs."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class SequenceDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    index: int
    token_ids: list[int]
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id, when one ended it
    # Sent with a sequence's first tokens:
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens [start, start + len) of a request."""

    request_id: str
    start: int
    logprobs: TokenLogprobs


class EngineStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class RequestFailed(msgspec.Struct, array_like=True):
    request_id: str
    error_type: str
    message: str


class StepOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[SequenceDelta]
    prompt_logprobs: list[PromptLogprobs]
    failed: list[RequestFailed]
    stats: EngineStats
    # time.monotonic() when the engine sent the step: one system-wide clock
    # for both processes, so the frontend can time its own share of a token.
    sent_at: float = 0.0


class Ready(msgspec.Struct, tag="ready"):
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    load_seconds: float


class EngineDead(msgspec.Struct, tag="dead"):
    message: str


EngineOutput = StepOutputs | Ready | EngineDead

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
output_decoder = msgspec.msgpack.Decoder(EngineOutput)
