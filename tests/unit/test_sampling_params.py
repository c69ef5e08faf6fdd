"""SamplingParams: vLLM defaults, normalisation and validation."""

from __future__ import annotations

import math

import pytest

from ferrox.common.errors import FerroxError, InvalidArgumentError
from ferrox.common.sampling_params import SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert params.n == 1
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.temperature == 1.0
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.frequency_penalty == params.presence_penalty == 0.0
    assert params.seed is None
    assert params.stop == [] and params.stop_token_ids == []
    assert params.ignore_eos is False
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.logit_bias is None
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert params.include_stop_str_in_output is False
    assert not params.is_greedy


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(7, 8)).stop_token_ids == [7, 8]  # type: ignore[arg-type]


def test_numbers_are_stored_as_python_types():
    params = SamplingParams(temperature=0, top_p=1, presence_penalty=-2)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.presence_penalty == -2.0


def test_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.1).is_greedy


def test_max_tokens_none_means_up_to_the_context_limit():
    params = SamplingParams(max_tokens=None, min_tokens=1000)
    assert params.max_tokens is None and params.min_tokens == 1000


def test_disabled_top_k_values():
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=50).top_k == 50


def test_logit_bias_is_clamped():
    params = SamplingParams(logit_bias={1: 250.0, 2: -1e9, 3: 5})
    assert params.logit_bias == {1: 100.0, 2: -100.0, 3: 5.0}


def test_clone_is_deep():
    params = SamplingParams(stop=["x"], stop_token_ids=[3], logit_bias={1: 1.0}, seed=5)
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")  # type: ignore[union-attr]
    copy.stop_token_ids.append(4)  # type: ignore[union-attr]
    copy.logit_bias[2] = 2.0  # type: ignore[index]
    assert params.stop == ["x"] and params.stop_token_ids == [3]
    assert params.logit_bias == {1: 1.0}


def test_accepts_the_edges_of_every_range():
    SamplingParams(
        n=1,
        max_tokens=1,
        min_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        repetition_penalty=1e-3,
        frequency_penalty=2.0,
        presence_penalty=-2.0,
        seed=2**64 - 1,
        logprobs=0,
        prompt_logprobs=0,
        logit_bias={0: -100.0},
    )
    SamplingParams(top_p=1e-9, min_p=0.0, seed=-(2**63))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, r"n must be in \[1, 2147483647\]"),
        ("n", 2**31, r"n must be in \[1, 2147483647\]"),
        ("n", 1.0, "n must be an int"),
        ("n", True, "n must be an int"),
        ("max_tokens", 0, r"max_tokens must be in \[1, 2147483647\]"),
        ("max_tokens", 2**64, r"max_tokens must be in \[1, 2147483647\]"),
        ("max_tokens", "16", "max_tokens must be an int"),
        ("min_tokens", -1, r"min_tokens must be in \[0, 2147483647\]"),
        ("min_tokens", 17, r"min_tokens must be in \[0, max_tokens=16\]"),
        ("temperature", -0.1, r"temperature must be a finite number in \[0, inf\)"),
        ("temperature", math.nan, "temperature must be a finite number"),
        ("temperature", math.inf, "temperature must be a finite number"),
        ("temperature", "hot", "temperature must be a number"),
        ("top_p", 0.0, r"top_p must be a finite number in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be a finite number in \(0, 1\]"),
        ("top_k", -2, r"top_k must be in \[-1, 2147483647\] \(-1 or 0 disables it\)"),
        ("top_k", 2**70, r"top_k must be in \[-1, 2147483647\]"),
        ("top_k", 1.5, "top_k must be an int"),
        ("min_p", -0.1, r"min_p must be a finite number in \[0, 1\]"),
        ("min_p", 1.1, r"min_p must be a finite number in \[0, 1\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be a finite number in \(0, inf\)"),
        ("frequency_penalty", 2.5, r"frequency_penalty must be a finite number in \[-2, 2\]"),
        ("presence_penalty", -2.1, r"presence_penalty must be a finite number in \[-2, 2\]"),
        ("seed", 1.5, "seed must be an int"),
        ("seed", "42", "seed must be an int"),
        ("seed", 2**64, "seed must be in"),
        ("logprobs", -1, r"logprobs must be in \[0, 2147483647\]"),
        ("logprobs", 1.0, "logprobs must be an int"),
        ("prompt_logprobs", -1, r"prompt_logprobs must be in \[0, 2147483647\]"),
        ("stop", "", "stop strings must be non-empty"),
        ("stop", ["ok", ""], "stop strings must be non-empty"),
        ("stop", [1], "stop must contain only str"),
        ("stop", {"a"}, "stop must be a str, a list of str or None"),
        ("stop_token_ids", [1, -1], r"stop_token_ids entries must be in \[0, 2147483647\]"),
        ("stop_token_ids", [2**31], r"stop_token_ids entries must be in \[0, 2147483647\]"),
        ("stop_token_ids", [1.0], "stop_token_ids entries must be an int"),
        ("stop_token_ids", 5, "stop_token_ids must be a list of int"),
        ("logit_bias", [1.0], r"logit_bias must be a dict\[int, float\]"),
        ("logit_bias", {"5": 1.0}, r"logit_bias keys \(token ids\) must be an int"),
        ("logit_bias", {-1: 1.0}, r"logit_bias keys \(token ids\) must be in \[0, 2147483647\]"),
        ("logit_bias", {5: math.nan}, "logit_bias values must be a finite number"),
        ("logit_bias", {5: "1"}, "logit_bias values must be a number"),
        ("ignore_eos", 1, "ignore_eos must be a bool"),
        ("skip_special_tokens", "no", "skip_special_tokens must be a bool"),
        ("spaces_between_special_tokens", None, "spaces_between_special_tokens must be a bool"),
        ("include_stop_str_in_output", 0, "include_stop_str_in_output must be a bool"),
    ],
)
def test_rejects_out_of_range_values(field, value, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError) and isinstance(info.value, FerroxError)
