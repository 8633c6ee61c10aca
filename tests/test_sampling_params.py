"""SamplingParams validation: every out-of-range field raises InvalidArgumentError naming it."""

from __future__ import annotations

import pytest

from kvray.engine.sampling_params import SamplingParams
from kvray.errors import InvalidArgumentError, KvrayError


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", -1),
        ("temperature", -0.01),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_out_of_range_field_raises_naming_it(field, value):
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**{field: value})
    err = info.value
    assert err.field == field
    assert err.value == value
    assert field in str(err) and err.allowed in str(err)
    assert isinstance(err, ValueError) and isinstance(err, KvrayError)


@pytest.mark.parametrize("stop", ["", ["ok", ""], [""]])
def test_empty_stop_string_raises_naming_stop(stop):
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(stop=stop)
    assert info.value.field == "stop"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 1},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"repetition_penalty": 1e-3},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"min_tokens": 0},
        {"logprobs": 0},
        {"logprobs": 20},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(params, k) == v


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert not p.greedy


def test_top_k_zero_means_all_tokens():
    assert SamplingParams(top_k=0).top_k == -1


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "bb"]).stop_strings == ["a", "bb"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-4, False), (0.7, False)])
def test_greedy_is_temperature_near_zero(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy
