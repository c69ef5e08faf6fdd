"""OpenAI request/response schemas and their translation into SamplingParams."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox.common.errors import ContextLengthExceededError, InvalidArgumentError
from ferrox.common.sampling_params import SamplingParams
from ferrox.server.openai_protocol import (
    BadRequest,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    random_id,
)
from ferrox.server.request_translation import (
    ServerLimits,
    chat_messages,
    completion_prompts,
    sampling_params_from,
)

openai_types = pytest.importorskip("openai.types")
openai_chat = pytest.importorskip("openai.types.chat")
openai_models = pytest.importorskip("openai._models")

LIMITS = ServerLimits()
USER = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.json.decode(
        msgspec.json.encode({"prompt": "hi", **fields}), type=CompletionRequest
    )


def chat(**fields: Any) -> ChatCompletionRequest:
    body = msgspec.json.encode({"messages": USER, **fields})
    return msgspec.json.decode(body, type=ChatCompletionRequest)


def params(
    request: CompletionRequest | ChatCompletionRequest,
    max_model_len: int = 128,
    prompt_len: int = 8,
    limits: ServerLimits = LIMITS,
) -> SamplingParams:
    return sampling_params_from(
        request, max_model_len=max_model_len, prompt_len=prompt_len, limits=limits
    )


def wire(struct: msgspec.Struct) -> dict[str, Any]:
    return msgspec.json.decode(msgspec.json.encode(struct))


# ---- decoding requests ---------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert completion_prompts(completion(prompt=prompt)) == expected


def test_completion_request_decodes_every_field_and_ignores_unknown_ones() -> None:
    request = completion(
        model="m",
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=3,
        echo=True,
        stop=["x", "y"],
        presence_penalty=0.1,
        frequency_penalty=-0.1,
        logit_bias={"7": 5.0},
        seed=42,
        user="u",
        best_of=2,
        suffix=None,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=1,
        ignore_eos=True,
        stop_token_ids=[9],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        prompt_logprobs=1,
        priority=-1,
        some_new_openai_field={"anything": [1]},
    )
    assert request.stream_options is not None and request.stream_options.include_usage
    assert request.priority == -1
    sp = params(request)
    assert (sp.n, sp.max_tokens, sp.min_tokens, sp.temperature, sp.top_k) == (2, 5, 1, 0.5, 40)
    assert sp.stop == ["x", "y"] and sp.stop_token_ids == [9] and sp.logit_bias == {7: 5.0}
    assert (sp.logprobs, sp.prompt_logprobs, sp.seed) == (3, 3, 42)
    assert sp.ignore_eos and not sp.skip_special_tokens and sp.include_stop_str_in_output


def test_nulls_mean_defaults() -> None:
    nulls = dict.fromkeys(
        ["model", "temperature", "top_p", "n", "stream", "stop", "seed", "logit_bias", "top_k"]
    )
    sp = params(completion(**nulls))
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.stop) == (1, 1.0, 1.0, 0, [])
    assert sp.max_tokens == 16  # the completions default


def test_chat_request_decodes_messages_of_every_kind() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "t"},
    ]
    request = chat(messages=messages, add_generation_prompt=False, chat_template="{{ x }}")
    assert not request.add_generation_prompt and request.chat_template == "{{ x }}"
    assert chat_messages(request) == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "t"},
    ]


def test_chat_max_completion_tokens_wins_and_logprobs_map() -> None:
    sp = params(chat(max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=4))
    assert (sp.max_tokens, sp.logprobs) == (7, 4)
    assert params(chat(logprobs=True)).logprobs == 0
    assert params(chat(logprobs=False)).logprobs is None
    assert params(chat(), max_model_len=100, prompt_len=30).max_tokens == 70


def test_tokenize_and_detokenize_requests() -> None:
    by_prompt = msgspec.json.decode(b'{"prompt": "hi"}', type=TokenizeRequest)
    assert by_prompt.add_special_tokens and by_prompt.messages is None
    body = b'{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false}'
    by_messages = msgspec.json.decode(body, type=TokenizeRequest)
    assert chat_messages(by_messages) == USER and not by_messages.add_generation_prompt
    for body in (b"{}", b'{"prompt": "a", "messages": []}'):
        with pytest.raises(msgspec.ValidationError, match="exactly one"):
            msgspec.json.decode(body, type=TokenizeRequest)
    assert msgspec.json.decode(b'{"tokens": [1, 2]}', type=DetokenizeRequest).tokens == [1, 2]


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (CompletionRequest, b"{}"),
        (CompletionRequest, b'{"prompt": 5}'),
        (CompletionRequest, b'{"prompt": [1.5]}'),
        (CompletionRequest, b'{"prompt": "a", "max_tokens": "5"}'),
        (CompletionRequest, b'{"prompt": "a", "max_tokens": 5.0}'),
        (CompletionRequest, b'{"prompt": "a", "temperature": "hot"}'),
        (CompletionRequest, b'{"prompt": "a", "stream": 1}'),
        (CompletionRequest, b'{"prompt": "a", "stop": [1]}'),
        (CompletionRequest, b'{"prompt": "a", "logit_bias": {"1": "x"}}'),
        (CompletionRequest, b'{"prompt": "a", "stream_options": {"include_usage": "yes"}}'),
        (ChatCompletionRequest, b'{"messages": "hi"}'),
        (ChatCompletionRequest, b'{"messages": [{"role": "robot", "content": "x"}]}'),
        (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": 3}]}'),
        (ChatCompletionRequest, b'{"messages": [], "logprobs": 2}'),
        (DetokenizeRequest, b'{"tokens": ["a"]}'),
        (CompletionRequest, b"[1, 2]"),
    ],
)
def test_wrong_json_types_are_validation_errors(kind: type, body: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=kind)


# ---- BadRequest rules ------------------------------------------------------------


def bad(request: Any, **kwargs: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        params(request, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": ""}, "suffix"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ""}, "stop"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1.0}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_completion_bad_requests_name_their_param(
    request_fields: dict[str, Any], param: str
) -> None:
    error = bad(completion(**request_fields))
    assert error.param == param and error.code is None
    assert isinstance(error, InvalidArgumentError) and error.message == str(error)


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 100}, "n"),
    ],
)
def test_chat_bad_requests_name_their_param(request_fields: dict[str, Any], param: str) -> None:
    assert bad(chat(**request_fields)).param == param


def test_limits_are_configurable() -> None:
    limits = ServerLimits(max_n=2, max_logprobs=1, max_stop_strings=1, max_stop_string_len=2)
    assert params(completion(n=2, logprobs=1, stop="ab"), limits=limits).n == 2
    for fields in ({"n": 3}, {"logprobs": 2}, {"stop": ["a", "b"]}, {"stop": "abc"}):
        with pytest.raises(BadRequest):
            params(completion(**fields), limits=limits)
    with pytest.raises(InvalidArgumentError):
        ServerLimits(max_n=-1)


@pytest.mark.parametrize(
    ("body", "param", "max_model_len", "prompt_len"),
    [
        (completion(max_tokens=100), "max_tokens", 100, 1),
        (chat(max_completion_tokens=100), "max_completion_tokens", 100, 1),
        (chat(max_tokens=100), "max_tokens", 100, 1),
        (completion(max_tokens=None), "prompt", 100, 100),
        (chat(), "messages", 100, 150),
    ],
)
def test_context_length_errors(body: Any, param: str, max_model_len: int, prompt_len: int) -> None:
    error = bad(body, max_model_len=max_model_len, prompt_len=prompt_len)
    assert isinstance(error, ContextLengthExceededError)
    assert (error.param, error.code) == (param, "context_length_exceeded")
    assert str(max_model_len) in str(error) and str(prompt_len) in str(error)


def test_max_tokens_fits_exactly_or_is_clamped_when_omitted() -> None:
    assert params(completion(max_tokens=99), max_model_len=100, prompt_len=1).max_tokens == 99
    assert params(completion(max_tokens=None), max_model_len=100, prompt_len=1).max_tokens == 99


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert params(completion(echo=True, logprobs=2)).prompt_logprobs == 2
    assert params(completion(echo=True, logprobs=2, prompt_logprobs=5)).prompt_logprobs == 5
    assert params(completion(echo=False, logprobs=2)).prompt_logprobs is None
    assert params(completion(echo=True)).prompt_logprobs is None


@pytest.mark.parametrize("prompt", [[], "", [""], ["a", ""], [[]], [[1], []], ["a", 1], [-1]])
def test_bad_prompts(prompt: Any) -> None:
    with pytest.raises(BadRequest) as info:
        completion_prompts(completion(prompt=prompt))
    assert info.value.param == "prompt"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user", "content": None}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ],
)
def test_bad_messages(messages: list[Any]) -> None:
    with pytest.raises(BadRequest) as info:
        chat_messages(chat(messages=messages))
    assert info.value.param == "messages"


def test_image_parts_stay_parts_and_others_get_a_clear_message() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:x", "detail": "auto"}}
    text = {"type": "text", "text": "what is it?"}
    (message,) = chat_messages(chat(messages=[{"role": "user", "content": [image, text]}]))
    assert message["content"] == [{"type": "image_url", "image_url": {"url": "data:x"}}, text]
    low = {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}}
    with pytest.raises(BadRequest, match="image detail 'low' is not served"):
        chat_messages(chat(messages=[{"role": "user", "content": [low]}]))
    audio = {"type": "input_audio", "input_audio": {}}
    with pytest.raises(BadRequest, match="of type 'input_audio'; only 'text' and 'image_url'"):
        chat_messages(chat(messages=[{"role": "user", "content": [audio]}]))


# ---- responses through the official SDK's models ------------------------------


def test_completion_response_parses_with_the_sdk() -> None:
    logprobs = CompletionLogprobs(
        tokens=["a", "b"],
        token_logprobs=[-0.5, -1.0],
        top_logprobs=[{"a": -0.5}, {"b": -1.0, "c": -2.0}],
        text_offset=[0, 1],
    )
    response = CompletionResponse(
        id=random_id("cmpl"),
        model="m",
        choices=[
            CompletionChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length"),
            CompletionChoice(index=1, text="x", finish_reason="stop", stop_reason="\n"),
        ],
        usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
    )
    body = wire(response)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][1]["logprobs"] is None
    parsed = openai_types.Completion.model_validate(body)
    assert parsed.choices[0].logprobs.top_logprobs[1] == {"b": -1.0, "c": -2.0}
    assert parsed.usage.total_tokens == 5 and isinstance(parsed.created, int)


def test_completion_stream_chunks_parse_with_the_sdk() -> None:
    chunk = CompletionStreamResponse(
        id="cmpl-1", model="m", choices=[CompletionChoice(index=0, text="a")]
    )
    body = wire(chunk)
    assert body["choices"][0]["finish_reason"] is None and "usage" not in body
    # The SDK reads stream events without validation (its Completion type says
    # finish_reason is never null, yet OpenAI sends null until the last event).
    parsed = openai_models.construct_type(type_=openai_types.Completion, value=body)
    assert parsed.choices[0].text == "a" and parsed.object == "text_completion"
    last = CompletionStreamResponse(
        id="cmpl-1",
        model="m",
        choices=[],
        usage=UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    assert openai_types.Completion.model_validate(wire(last)).usage.total_tokens == 2


def test_chat_response_parses_with_the_sdk() -> None:
    token = ChatLogprobToken(
        token="hi",
        logprob=-0.1,
        bytes=list(b"hi"),
        top_logprobs=[TopLogprob(token="hi", logprob=-0.1, bytes=list(b"hi"))],
    )
    response = ChatCompletionResponse(
        id=random_id("chatcmpl"),
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatMessage(content="hi"),
                logprobs=ChatLogprobs(content=[token]),
                finish_reason="stop",
            ),
            ChatCompletionChoice(index=1, message=ChatMessage(content=""), finish_reason="length"),
        ],
        usage=UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4),
    )
    body = wire(response)
    assert body["object"] == "chat.completion" and body["choices"][1]["logprobs"] is None
    parsed = openai_chat.ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [104, 105]


def test_chat_stream_chunks_parse_with_the_sdk() -> None:
    first = ChatCompletionStreamResponse(
        id="chatcmpl-1",
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant"))],
    )
    body = wire(first)
    assert body["object"] == "chat.completion.chunk"
    assert body["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant"},
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }
    assert openai_chat.ChatCompletionChunk.model_validate(body).choices[0].delta.role == "assistant"
    end = ChatCompletionStreamResponse(
        id="chatcmpl-1",
        model="m",
        choices=[
            ChatCompletionStreamChoice(
                index=0, delta=DeltaMessage(content="!"), finish_reason="stop"
            )
        ],
    )
    assert openai_chat.ChatCompletionChunk.model_validate(wire(end)).choices[0].delta.content == "!"
    usage = ChatCompletionStreamResponse(
        id="chatcmpl-1",
        model="m",
        choices=[],
        usage=UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    assert openai_chat.ChatCompletionChunk.model_validate(wire(usage)).usage.prompt_tokens == 1


def test_models_tokenize_and_error_bodies() -> None:
    models = wire(ModelList(data=[ModelCard(id="m", max_model_len=2048)]))
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert openai_types.Model.model_validate(models["data"][0]).owned_by == "ferrox"
    assert wire(TokenizeResponse(tokens=[1], count=1, max_model_len=8)) == {
        "tokens": [1],
        "count": 1,
        "max_model_len": 8,
    }
    assert wire(DetokenizeResponse(prompt="hi")) == {"prompt": "hi"}
    error = ErrorResponse(error=ErrorInfo(message="bad", param="n"))
    assert wire(error) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }


def test_random_ids_are_unique() -> None:
    assert len({random_id("cmpl") for _ in range(100)}) == 100


# ---- property: BadRequest or valid SamplingParams, nothing else ------------------

wild_ints = st.integers(-(2**70), 2**70)
wild_floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(max_size=300)


def mostly(valid: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a sensible value, one time in four anything of the right JSON type."""
    return st.integers(0, 3).flatmap(lambda k: wild if k == 3 else valid)


def small(low: int, high: int) -> st.SearchStrategy[int | None]:
    return st.none() | st.integers(low, high)


shared_fields = {
    "temperature": mostly(st.floats(0, 2), wild_floats),
    "top_p": mostly(st.floats(0.01, 1), wild_floats),
    "n": mostly(small(1, 4), wild_ints),
    "stop": mostly(
        st.none() | st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1), max_size=3),
        texts | st.lists(texts, max_size=20),
    ),
    "presence_penalty": mostly(st.floats(-2, 2), wild_floats),
    "frequency_penalty": mostly(st.floats(-2, 2), wild_floats),
    "logit_bias": mostly(
        st.dictionaries(st.integers(0, 1000).map(str), st.floats(-200, 200), max_size=3),
        st.dictionaries(st.text(max_size=6) | wild_ints.map(str), wild_floats),
    ),
    "seed": mostly(small(0, 2**32), wild_ints),
    "top_k": mostly(small(-1, 50), wild_ints),
    "min_p": mostly(st.floats(0, 1), wild_floats),
    "repetition_penalty": mostly(st.floats(0.5, 2), wild_floats),
    "min_tokens": mostly(st.integers(0, 3), st.integers(-5, 10**6)),
    "stop_token_ids": mostly(st.lists(st.integers(0, 1000), max_size=3), st.lists(wild_ints)),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "prompt_logprobs": mostly(small(0, 5), wild_ints),
}
completion_fields = {
    "max_tokens": mostly(small(1, 64), wild_ints),
    "logprobs": mostly(small(0, 5), wild_ints),
    "echo": st.booleans(),
    "best_of": mostly(st.none(), wild_ints),
    "suffix": mostly(st.none(), texts),
}
chat_fields = {
    "max_tokens": mostly(small(1, 64), wild_ints),
    "max_completion_tokens": mostly(small(1, 64), wild_ints),
    "logprobs": st.none() | st.booleans(),
    "top_logprobs": mostly(small(0, 5), wild_ints),
}
completion_requests = st.fixed_dictionaries(
    {}, optional={**shared_fields, **completion_fields}
).map(lambda fields: CompletionRequest(prompt="x", **fields))
chat_requests = st.fixed_dictionaries({}, optional={**shared_fields, **chat_fields}).map(
    lambda fields: ChatCompletionRequest(messages=[], **fields)
)


@settings(max_examples=400, deadline=None)
@given(
    body=st.one_of(completion_requests, chat_requests),
    prompt_len=st.integers(0, 4096),
    room=mostly(st.integers(1, 4096), st.integers(-10, 0)),
)
def test_sampling_params_from_is_total(
    body: CompletionRequest | ChatCompletionRequest, prompt_len: int, room: int
) -> None:
    max_model_len = prompt_len + room
    try:
        sp = params(body, max_model_len=max_model_len, prompt_len=prompt_len)
    except BadRequest as error:
        assert str(error) and (error.param is None or isinstance(error.param, str))
        return
    assert isinstance(sp, SamplingParams)
    assert sp.max_tokens is not None and 1 <= sp.max_tokens <= max_model_len - prompt_len
    assert 1 <= sp.n <= LIMITS.max_n
    assert sp.logprobs is None or sp.logprobs <= LIMITS.max_logprobs
    assert len(sp.stop or []) <= LIMITS.max_stop_strings
    SamplingParams(**{name: getattr(sp, name) for name in sp.__dataclass_fields__})
