"""Validation at intake, without a model: every token id against the vocabulary, numbers
finite, seeds mapped into the generator's range, stop strings and grammars bounded, the
request body walked for NaN and nesting, the step's per-request work in one op (checked
against a hand-made reference), and the grammar cache bounded."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvray.engine.request_limits import RequestLimits, nesting_depth
from kvray.engine.sampler import Sampler, SampleRow
from kvray.engine.sampling_params import SEED_MODULUS, SamplingParams, sample_seed
from kvray.engine.structured_outputs import StructuredOutputsParams
from kvray.errors import InvalidArgumentError

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, max_stop_strings=4, max_stop_string_length=8)


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=math.nan), "top_p"),
        (dict(presence_penalty=-math.inf), "presence_penalty"),
        (dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(seed=SEED_MODULUS), "seed"),
        (dict(seed=-(1 << 63) - 1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(stop_token_ids=[-100000]), "stop_token_ids"),
        (dict(stop_token_ids=["7"]), "stop_token_ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
        (dict(logit_bias={3: math.nan}), "logit_bias[3]"),
        (dict(logit_bias={3: 100.5}), "logit_bias[3]"),
        (dict(cache_salt=""), "cache_salt"),
    ],
)
def test_sampling_params_refuse_naming_the_field(kwargs, field):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_nan_is_named_as_not_finite():
    with pytest.raises(InvalidArgumentError, match="a finite number in"):
        SamplingParams(temperature=math.nan)


def test_seeds_of_int64_and_uint64_map_into_the_generators_range():
    assert SamplingParams(seed=-1).seed == SEED_MODULUS - 1
    assert SamplingParams(seed=-(1 << 63)).seed == 1 << 63
    assert SamplingParams(seed=SEED_MODULUS - 1).seed == SEED_MODULUS - 1
    assert sample_seed(SEED_MODULUS - 1, 2) == 1  # sample 2 of the largest seed wraps round
    assert sample_seed(None, 3) is None
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(300)}).logit_bias) == 300  # the cap itself


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(stop_token_ids=[100]), "stop_token_ids"),
        (dict(logit_bias={100: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[5, 100]), "allowed_token_ids"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(stop=["123456789"]), "stop"),
        (
            dict(structured_outputs=StructuredOutputsParams(json=_nested_schema(40))),
            "structured_outputs.json",
        ),
        (
            dict(structured_outputs=StructuredOutputsParams(regex="a" * (65 << 10))),
            "structured_outputs.regex",
        ),
        (dict(structured_outputs=StructuredOutputsParams(json="[" * 100_000)), "structured_outputs.json"),
    ],
)
def test_limits_refuse_what_the_model_cannot_take(kwargs, field):
    with pytest.raises(InvalidArgumentError) as e:
        LIMITS.check([1, 2, 3], SamplingParams(**kwargs))
    assert e.value.field == field


def test_limits_take_what_fits_exactly():
    LIMITS.check(
        [0, 99] + [1] * 61, SamplingParams(stop=["12345678"] * 4, stop_token_ids=[99], logit_bias={99: 1})
    )
    LIMITS.check([1], SamplingParams(structured_outputs=StructuredOutputsParams(json=_nested_schema(31))))


@pytest.mark.parametrize(
    "prompt",
    [[], [1] * 64, [100], [-1], [1.0, 2.0], [True]],
    ids=["empty", "too-long", "vocab", "neg", "floats", "bool"],
)
def test_bad_prompts_are_named(prompt):
    with pytest.raises(InvalidArgumentError) as e:
        LIMITS.check_prompt(prompt)
    assert e.value.field == "prompt"


def test_nesting_depth_is_counted_without_recursion():
    deep: list = []
    for _ in range(50_000):  # far past Python's recursion limit
        deep = [deep]
    assert nesting_depth(deep, 10) == 11  # stops early, once past the bound
    assert nesting_depth({"a": [1, {"b": 2}]}, 10) == 3
    assert nesting_depth(7, 10) == 0


# ---- the step's per-request work: one op for the batch, against a row-by-row reference --


def _row(rid: str, **params) -> SampleRow:
    return SampleRow(rid, SamplingParams(temperature=0.0, **params), 0, 0, [], [])


def test_bias_allowed_and_suppressed_tokens_match_a_row_by_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    rows = [
        _row("a", logit_bias={1: 2.5, 7: -100.0}),
        _row("b", allowed_token_ids=[3, 4]),
        _row("c"),
        _row("d", logit_bias={4: 1.0}, allowed_token_ids=[4, 9]),
    ]
    rows[2].suppressed_token_ids = [0, 5]
    want = logits.clone()
    want[0, 1] += 2.5
    want[0, 7] -= 100.0
    want[1, [0, 1, 2, 5, 6, 7, 8, 9]] = -math.inf
    want[2, [0, 5]] = -math.inf
    want[3, 4] += 1.0
    want[3, [0, 1, 2, 3, 5, 6, 7, 8]] = -math.inf
    before = logits.clone()
    got = Sampler(10).process(logits, rows)
    assert torch.equal(got, want)
    assert torch.equal(logits, before)  # the input is left alone (a copy where it changes)
    assert Sampler(10)(logits, rows).token_ids == want.argmax(-1).tolist()


def test_a_batch_that_fails_is_redone_drawing_the_same_numbers():
    """A seeded request's generator is put back where it was before a failed pass: its
    token when redone equals the token of a pass that never failed."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    row = SampleRow("s", SamplingParams(temperature=1.0, seed=7), 0, 0, [], [])
    clean = Sampler(50)
    clean(logits, [row])  # a first token: the generator exists and has moved on
    want = clean(logits, [row]).token_ids
    sampler = Sampler(50)
    sampler(logits, [row])
    saved = sampler.save_generators([row])
    sampler(logits, [row])  # a pass whose result is thrown away (as if it had failed)
    sampler.restore_generators(saved)
    assert sampler(logits, [row]).token_ids == want


def test_a_row_left_with_no_token_fails_instead_of_sampling_token_0():
    row = _row("a", allowed_token_ids=[5], stop_token_ids=[5])
    row.suppressed_token_ids = [5]  # its only allowed token is a stop token before min_tokens
    with pytest.raises(ValueError, match="no token is left to sample for a"):
        Sampler(10).process(torch.randn(1, 10), [row])


def test_a_step_whose_batch_fails_gives_the_others_the_tokens_of_a_clean_run():
    """sample_step: one row breaks the batched pass (a bias past the vocabulary, set after
    intake); it alone gets an error, and a seeded row beside it draws what it draws alone
    (its generator put back, or dropped when the failed pass had made it)."""
    from kvray.engine.step_sampling import sample_step

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    seeded = SampleRow("s", SamplingParams(temperature=1.0, seed=3), 0, 0, [], [])
    broken = SampleRow("b", SamplingParams(temperature=0.5), 0, 0, [], [])
    broken.sampling_params.logit_bias = {10**9: 1.0}
    clean, dirty = Sampler(50), Sampler(50)
    for _ in range(3):  # the first pass makes the seeded generator; the later ones restore it
        want = sample_step(clean, logits[:1], [seeded], ["s"], None)
        got = sample_step(dirty, logits, [seeded, broken], ["s", "b"], None)
        assert got.token_ids[0] == want.token_ids[0] and got.token_ids[1] == []
        assert list(got.errors) == ["b"] and "IndexError" in got.errors["b"]


# ---- the request body -------------------------------------------------------------------


def test_the_body_is_walked_for_non_finite_numbers_and_nesting():
    from kvray.router.api_error import APIError
    from kvray.router.request_body import MAX_BODY_DEPTH, check_body

    check_body({"prompt": [1, 2, 3], "temperature": 0.5, "messages": [{"content": [{"text": "x"}]}]})
    for body, param, words in [
        (json.loads('{"temperature": NaN}'), "temperature", "nan is not a finite number"),
        (json.loads('{"logit_bias": {"5": -Infinity}}'), "logit_bias", "logit_bias.5: -inf"),
        ({"metadata": {"a": [0.5, math.inf]}}, "metadata", "metadata.a[1]: inf"),
        (
            json.loads('{"x": ' + "[" * (MAX_BODY_DEPTH + 1) + "]" * (MAX_BODY_DEPTH + 1) + "}"),
            "x",
            "nested deeper",
        ),
    ]:
        with pytest.raises(APIError) as e:
            check_body(body)
        assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


# ---- the grammar cache ------------------------------------------------------------------


def test_the_grammar_cache_keeps_the_most_recent_within_its_bounds(smollm2_tokenizer):
    from kvray.engine.structured_outputs import GrammarCompiler

    compiler = GrammarCompiler(smollm2_tokenizer, 49152, frozenset({2}), max_entries=3)
    choices = [StructuredOutputsParams(choice=[f"yes{i}", "no"]) for i in range(5)]
    for so in choices[:3]:
        compiler.compile(so)
    compiler.compile(choices[0])  # used again: now the most recent
    compiler.compile(choices[3])  # evicts the least recent, choices[1]
    kept = set(compiler._cache)
    assert kept == {choices[i].key() for i in (0, 2, 3)}
    assert compiler.num_bytes == sum(len(k) + len(g) for k, g in compiler._cache.items())
    small = GrammarCompiler(smollm2_tokenizer, 49152, frozenset({2}), max_bytes=compiler.num_bytes // 3 + 1)
    for so in choices:
        small.compile(so)
    assert len(small) == 1 and small.num_bytes <= compiler.num_bytes // 3 + 1
