"""From OpenAI request bodies to engine inputs: prompts, chat messages and
SamplingParams. Every rejection is a ``BadRequest`` that names its field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, cast

from ferrox.common.config import EngineConfig
from ferrox.common.errors import InvalidArgumentError
from ferrox.common.sampling_params import SamplingParams, check_priority
from ferrox.common.structured_outputs import StructuredOutputsParams
from ferrox.server.openai_protocol import (
    BadRequest,
    ChatCompletionRequest,
    ChatMessageParam,
    CompletionRequest,
    ContentPart,
    ContextLengthBadRequest,
    TokenizeRequest,
)
from ferrox.server.output_constraints import structured_outputs_from

_SAMPLING_PARAM_NAMES = frozenset(field.name for field in fields(SamplingParams))
# Longer keys cannot be token ids (and would trip Python's int-parsing digit limit).
_MAX_TOKEN_ID_DIGITS = 20


@dataclass(frozen=True)
class ServerLimits:
    """Caps on one request that the server enforces beyond SamplingParams' checks."""

    max_n: int = 16
    # For logprobs, top_logprobs and prompt_logprobs; the engine's own limit.
    max_logprobs: int = EngineConfig.max_logprobs
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_prompts: int = 256  # prompts in one completions request
    max_logit_bias: int = 1024  # logit_bias entries
    max_stop_token_ids: int = 256

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{field.name} must be an int >= 0, got {value!r}")


def sampling_params_from(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    max_model_len: int,
    prompt_len: int,
    limits: ServerLimits,
    defaults: Mapping[str, Any] | None = None,
    tool_outputs: StructuredOutputsParams | None = None,
    disable_additional_properties: bool = False,
) -> SamplingParams:
    """The SamplingParams of one prompt of ``request``, which has ``prompt_len`` tokens.

    A field the request omits takes its value from ``defaults`` (the model's
    generation config), else SamplingParams' default; an omitted
    ``max_tokens`` becomes the default's, at most the room the prompt leaves
    in the context, else that room. `tool_outputs`: the grammar of a
    required or named tool_choice (see `output_constraints.tool_plan`).
    `disable_additional_properties`: the server's default for JSON schemas
    (see `output_constraints.structured_outputs_from`).
    """
    defaults = defaults or {}
    requested: int | None
    if isinstance(request, ChatCompletionRequest):
        prompt_param = "messages"
        if request.max_completion_tokens is not None:
            max_tokens_param, requested = "max_completion_tokens", request.max_completion_tokens
        else:
            max_tokens_param, requested = "max_tokens", request.max_tokens
    else:
        prompt_param, max_tokens_param, requested = "prompt", "max_tokens", request.max_tokens
    room = max_model_len - prompt_len
    if room <= 0:
        raise ContextLengthBadRequest(
            f"the prompt has {prompt_len} tokens, but the model's context length is "
            f"{max_model_len} tokens, which leaves no room for a completion",
            param=prompt_param,
        )
    if requested is None and defaults.get("max_tokens") is not None:
        max_tokens = min(int(defaults["max_tokens"]), room)
    else:
        max_tokens = _max_tokens(requested, max_tokens_param, room, max_model_len, prompt_len)
    try:
        check_priority(request.priority)
    except InvalidArgumentError as exc:
        raise BadRequest(str(exc), param="priority") from exc
    n = 1 if request.n is None else request.n
    if n > limits.max_n:
        raise BadRequest(f"n must be at most {limits.max_n}, got {n}", param="n")
    if isinstance(request, CompletionRequest):
        _check_unsupported_completion_fields(request, n)
    logprobs, prompt_logprobs = _logprobs(request, limits)

    optional: dict[str, Any] = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "seed": request.seed,
    }
    for name, value in defaults.items():
        if optional.get(name, False) is None:
            optional[name] = value
    stop = _stop_strings(request.stop, limits)
    if request.logit_bias is not None and len(request.logit_bias) > limits.max_logit_bias:
        raise BadRequest(
            f"logit_bias may hold at most {limits.max_logit_bias} entries, "
            f"got {len(request.logit_bias)}",
            param="logit_bias",
        )
    if (
        request.stop_token_ids is not None
        and len(request.stop_token_ids) > limits.max_stop_token_ids
    ):
        raise BadRequest(
            f"stop_token_ids may hold at most {limits.max_stop_token_ids} ids, "
            f"got {len(request.stop_token_ids)}",
            param="stop_token_ids",
        )
    logit_bias = _logit_bias(request.logit_bias)
    structured = structured_outputs_from(request, disable_additional_properties)
    if tool_outputs is not None:
        if structured is not None:
            raise BadRequest(
                "a required or named tool_choice cannot be combined with another output "
                "constraint (response_format, structured_outputs, guided_*)",
                param="tool_choice",
            )
        structured = tool_outputs
    try:
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            structured_outputs=structured,
            **{name: value for name, value in optional.items() if value is not None},
        )
    except InvalidArgumentError as exc:
        # SamplingParams' messages start with the parameter's name.
        name = str(exc).split(" ", 1)[0]
        raise BadRequest(str(exc), param=name if name in _SAMPLING_PARAM_NAMES else None) from exc


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: texts or token-id lists, never empty."""
    return prompt_list(request.prompt, "prompt")


def prompt_list(prompt: str | list[Any], param: str) -> list[str | list[int]]:
    """A string, strings, token ids or lists of them (the field `param`), as
    a list of prompts: texts or token-id lists, never empty."""
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(item, int) for item in prompt):
        prompts = [cast(list[int], list(prompt))]
    elif all(isinstance(item, str) for item in prompt) or all(
        isinstance(item, list) for item in prompt
    ):
        prompts = cast(list[str | list[int]], list(prompt))
    else:
        raise BadRequest(
            f"{param} must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists, not a mix of them",
            param=param,
        )
    if not prompts:
        raise BadRequest(f"{param} must not be empty", param=param)
    for item in prompts:
        if len(item) == 0:
            raise BadRequest(f"{param} must not contain an empty prompt", param=param)
        if isinstance(item, list) and min(item) < 0:
            raise BadRequest(f"{param} token ids must be >= 0, got {min(item)}", param=param)
    return prompts


def chat_messages(request: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
    """The messages as ``{"role": ..., "content": str, ...}`` dicts for
    ``apply_chat_template``, with their tool calls (arguments as mappings),
    tool-call ids and names.

    Text parts are joined with newlines; "developer" messages become "system" ones,
    the role chat templates know.
    """
    if not request.messages:
        raise BadRequest("messages must not be empty", param="messages")
    return [_message_dict(index, message) for index, message in enumerate(request.messages)]


def _max_tokens(
    requested: int | None, param: str, room: int, max_model_len: int, prompt_len: int
) -> int:
    if requested is None:
        return room
    if requested < 1:
        raise BadRequest(f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        raise ContextLengthBadRequest(
            f"{param}={requested} is more than the {room} tokens left: the model's context "
            f"length is {max_model_len} tokens and the prompt has {prompt_len}",
            param=param,
        )
    return requested


def _check_unsupported_completion_fields(request: CompletionRequest, n: int) -> None:
    if request.suffix is not None:
        raise BadRequest("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != n:
        raise BadRequest(
            f"best_of must be omitted or equal to n={n} (returning the best of several "
            f"completions is not supported), got {request.best_of}",
            param="best_of",
        )


def _logprobs(
    request: CompletionRequest | ChatCompletionRequest, limits: ServerLimits
) -> tuple[int | None, int | None]:
    """The (logprobs, prompt_logprobs) SamplingParams fields of ``request``."""
    prompt_logprobs = request.prompt_logprobs
    _check_at_most("prompt_logprobs", prompt_logprobs, limits.max_logprobs)
    if isinstance(request, ChatCompletionRequest):
        top = request.top_logprobs
        if top is not None:
            if not request.logprobs:
                raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
            if top < 0:
                raise BadRequest(f"top_logprobs must be >= 0, got {top}", param="top_logprobs")
            _check_at_most("top_logprobs", top, limits.max_logprobs)
        return ((top or 0) if request.logprobs else None), prompt_logprobs
    logprobs = request.logprobs
    _check_at_most("logprobs", logprobs, limits.max_logprobs)
    if request.echo and logprobs is not None:
        # The echoed prompt's tokens carry logprobs too.
        prompt_logprobs = logprobs if prompt_logprobs is None else max(prompt_logprobs, logprobs)
    return logprobs, prompt_logprobs


def _check_at_most(param: str, value: int | None, limit: int) -> None:
    if value is not None and value > limit:
        raise BadRequest(f"{param} must be at most {limit}, got {value}", param=param)


def _stop_strings(stop: str | list[str] | None, limits: ServerLimits) -> list[str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > limits.max_stop_strings:
        raise BadRequest(
            f"stop may hold at most {limits.max_stop_strings} strings, got {len(strings)}",
            param="stop",
        )
    for string in strings:
        if len(string) > limits.max_stop_string_len:
            raise BadRequest(
                f"stop strings may be at most {limits.max_stop_string_len} characters long, "
                f"got one of {len(string)}",
                param="stop",
            )
    return strings


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """Parses the token-id keys; SamplingParams checks their range and the values."""
    if bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        digits = key.removeprefix("-")
        if not (digits.isascii() and digits.isdigit() and len(digits) <= _MAX_TOKEN_ID_DIGITS):
            raise BadRequest(
                f"logit_bias keys must be token ids written as integers, got {key!r}",
                param="logit_bias",
            )
        parsed[int(key)] = value
    return parsed


def _message_dict(index: int, message: ChatMessageParam) -> dict[str, Any]:
    content = message.content
    text: str | list[dict[str, Any]]
    if content is None:
        if message.role != "assistant":
            raise BadRequest(
                f"messages[{index}] ({message.role}) has no content; only assistant "
                "messages may omit it",
                param="messages",
            )
        text = ""
    elif isinstance(content, str):
        text = content
    elif any(part.type == "image_url" for part in content):
        text = [_part_dict(index, part) for part in content]  # (frontend/media.py)
    else:
        text = "\n".join(_part_text(index, part) for part in content)
    role = "system" if message.role == "developer" else message.role
    entry: dict[str, Any] = {"role": role, "content": text}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise BadRequest(
                f"messages[{index}] ({message.role}) has tool_calls; only assistant messages "
                "may have them",
                param="messages",
            )
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        entry["reasoning_content"] = message.reasoning_content
    return entry


def _arguments(arguments: str | dict[str, Any]) -> Any:
    """A call's arguments as chat templates expect them: a mapping (they
    write it with `tojson`), or the text when it is not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _part_dict(index: int, part: ContentPart) -> dict[str, Any]:
    """A text or image part as chat_images (frontend/media.py) reads it."""
    if part.type == "image_url":
        if part.image_url is None:
            raise BadRequest(
                f"messages[{index}] has an 'image_url' part without image_url", param="messages"
            )
        check_detail(part.image_url.detail, f"messages[{index}]", "messages")
        return {"type": "image_url", "image_url": {"url": part.image_url.url}}
    return {"type": "text", "text": _part_text(index, part)}


def check_detail(detail: Any, what: str, param: str) -> None:
    """An image's `detail`: "auto" (the model's image processor picks the
    resolution, as it always does here) or absent; "low" and "high" are not
    honoured, so refused."""
    if detail not in (None, "auto"):
        raise BadRequest(
            f"{what}: image detail {detail!r} is not served (the model's image processor "
            "picks the resolution); give 'auto' or leave it out",
            param=param,
        )


def _part_text(index: int, part: ContentPart) -> str:
    if part.type != "text":
        raise BadRequest(
            f"messages[{index}] has a content part of type {part.type!r}; only 'text' and "
            "'image_url' parts are supported",
            param="messages",
        )
    if part.text is None:
        raise BadRequest(f"messages[{index}] has a 'text' part without text", param="messages")
    return part.text
