"""Messages between the frontend and the engine-core process: msgspec
structs sent as msgpack over ZMQ (never pickle)."""

from __future__ import annotations

import msgspec

from ferrox.common.lora import LoRARequest
from ferrox.common.multimodal import ImageInput, ImagePrompt
from ferrox.common.sampling_params import SamplingParams

# The engine sends a message at least this often, busy or idle, so that the
# frontend can tell a stuck or stopped engine from a quiet one.
HEARTBEAT_S = 1.0
# ZMQ high-water marks (messages) of the two directions.
INPUT_HWM = 100_000
OUTPUT_HWM = 10_000

# ---- frontend -> engine ------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    # The one definition, sent as it is; decoding runs its validation again.
    params: SamplingParams
    priority: int = 0
    lora: LoRARequest | None = None  # the LoRA adapter it runs under
    images: list[ImageInput] | None = None  # its processed images (placeholders in the prompt)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StopSequence(msgspec.Struct, array_like=True):
    """A sequence the caller ended (a stop string matched), and how many of
    its tokens it kept: those sampled after the stop are not counted."""

    request_id: str
    index: int
    num_output_tokens: int


class StopSequences(msgspec.Struct, tag="stop"):
    sequences: list[StopSequence]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    """Drop every cached prefix no request is using."""


class UnloadAdapter(msgspec.Struct, tag="unload_adapter"):
    """Drop a loaded LoRA adapter (once no request uses it)."""

    lora_name: str


class StartProfile(msgspec.Struct, tag="start_profile"):
    pass


class StopProfile(msgspec.Struct, tag="stop_profile"):
    pass


EngineInput = (
    AddRequest
    | AbortRequests
    | StopSequences
    | Shutdown
    | ResetPrefixCache
    | UnloadAdapter
    | StartProfile
    | StopProfile
)


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id, when one ended it
    # Sent with a sequence's first tokens:
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    first_token_time: float | None = None  # for a final-only request (else: on receipt)
    # Sent when the sequence finishes:
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # ... and kept
    embedding: list[float] | None = None  # an embedding request's, when it finishes


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
    # The sliding-window layers' pool (0 without one).
    num_window_blocks: int = 0
    num_free_window_blocks: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_lengths: list[int] = []  # [a]: verifications that kept a drafts
    spec_accepted_per_position: list[int] = []  # [i]: drafts kept at position i
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Idle-time integrity checks of the scheduler that failed (a bug in ferrox).
    integrity_failures: int = 0


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
    step_tokens: int = 0  # tokens the step computed (prefill chunks and decodes)


class Ready(msgspec.Struct, tag="ready"):
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    load_seconds: float
    device: str  # the torch device and dtype the model runs in: "cpu", "float32"
    dtype: str
    kv_dtype: str  # the KV cache's ("float16" under a CPU model's block weights)
    # A sequence classifier's labels (see CausalLM.labels); None for other models.
    labels: list[str] | None = None
    # With LoRA adapters: the decoder layers and, per module an adapter may
    # adapt, its [in_features, out_features] (common/lora.LoraTargets).
    lora_layers: int = 0
    lora_modules: dict[str, list[int]] | None = None
    # How a vision-language model's prompt holds an image; None: text only.
    image_prompt: ImagePrompt | None = None


class EngineDead(msgspec.Struct, tag="dead"):
    message: str


EngineOutput = StepOutputs | Ready | EngineDead

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
output_decoder = msgspec.msgpack.Decoder(EngineOutput)
