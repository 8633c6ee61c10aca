"""Structured outputs in the engine: a grammar's token bitmask inside the batched sampler.

Checked against independent references: `jsonschema` validates every JSON answer, `re`
full-matches the regex ones, the sampler's masking against hand-computed rows, and the
greedy tokens of a constrained request are the same alone, beside free requests, under
KV pressure (preempted and recomputed) and resumed from tokens made elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
from structured_schemas import PROMPT, SCHEMAS

from kvray.engine import LLM, AsyncLLM, EngineConfig, SamplingParams, StructuredOutputsParams
from kvray.engine.sampler import Sampler, SampleRow
from kvray.engine.structured_outputs import apply_token_bitmask, closed_objects
from kvray.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(model=str(smollm2_path), dtype="float32", max_model_len=512)


def _json(schema, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=160, structured_outputs=StructuredOutputsParams(json=schema), **kw)


def _bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bits as int32


# ---- the mask, by hand ---------------------------------------------------------------------


def test_the_bitmask_forbids_exactly_the_unset_bits():
    logits = torch.arange(70, dtype=torch.float32).repeat(3, 1)  # token 69 is everyone's best
    allowed = [0, 31, 32, 63, 64]  # word edges, and bit 31 (the int32 sign bit)
    masked = apply_token_bitmask(logits, [0, 2], [_bitmask(allowed, 70), _bitmask([5], 70)])
    assert [i for i in range(70) if masked[0, i] > float("-inf")] == allowed
    assert torch.equal(masked[1], logits[1])  # an unconstrained row is untouched
    assert [i for i in range(70) if masked[2, i] > float("-inf")] == [5]
    assert torch.equal(logits[0], torch.arange(70, dtype=torch.float32))  # the input is not changed


def test_constrained_and_free_rows_share_one_sampler_pass():
    vocab = 64
    logits = torch.zeros(3, vocab)
    logits[:, 10] = 5.0  # the best token of every row
    logits[:, 20] = 4.0
    logits[:, 30] = 3.0
    rows = [
        SampleRow("free", SamplingParams(temperature=0), 0, 0, [], []),
        SampleRow("json", SamplingParams(temperature=0), 0, 0, [], [], _bitmask([20, 30], vocab)),
        SampleRow("seeded", SamplingParams(temperature=1.0, seed=7), 0, 0, [], [], _bitmask([30], vocab)),
    ]
    out = Sampler(vocab)(logits, rows)
    assert out.token_ids == [10, 20, 30]  # greedy best / best allowed / the only allowed


def test_logit_bias_and_suppressed_tokens():
    vocab = 16
    logits = torch.zeros(2, vocab)
    logits[:, 3] = 1.0
    rows = [
        SampleRow("a", SamplingParams(temperature=0, logit_bias={7: 2.5}), 0, 0, [], []),
        SampleRow("b", SamplingParams(temperature=0), 0, 0, [], [], None, [3]),  # e.g. EOS before min_tokens
    ]
    assert Sampler(vocab)(logits, rows).token_ids == [7, 0]


# ---- through the engine, SmolLM2 -----------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_every_schema_holds(llm, temperature):
    names = list(SCHEMAS)
    params = [
        _json(SCHEMAS[n], temperature=temperature, seed=3, n=1 if temperature == 0 else 2) for n in names
    ]
    outs = llm.generate([PROMPT] * len(names), params)
    for name, out in zip(names, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
    assert len(llm.engine.grammars) >= len(names)  # each compiled once, cached


def test_closed_objects_closes_every_object_that_does_not_say():
    open_ = {"type": "object", "properties": {"a": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "person": open_,
            "tags": {"type": "array", "items": open_},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "properties": {"type": "string"},  # a property named like the keyword
            "meta": {"type": "object"},  # free-form: lists no keys, stays open
            "either": {"type": "object", "anyOf": [open_, {"patternProperties": {"^x": {}}}]},
        },
        "anyOf": [open_, {"type": "string"}],
        "$defs": {"d": {"properties": {"b": {"type": "integer"}}}},
    }
    closed = closed_objects(schema)
    shut = {**open_, "additionalProperties": False}
    assert closed == {
        "type": "object",
        "properties": {
            "person": shut,
            "tags": {"type": "array", "items": shut},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "properties": {"type": "string"},
            "meta": {"type": "object"},
            "either": {  # the parts close, not the object made of them (it would take no key)
                "type": "object",
                "anyOf": [shut, {"patternProperties": {"^x": {}}, "additionalProperties": False}],
            },
        },
        "anyOf": [shut, {"type": "string"}],
        "$defs": {"d": {"properties": {"b": {"type": "integer"}}, "additionalProperties": False}},
        "additionalProperties": False,
    }
    assert "additionalProperties" not in schema and "additionalProperties" not in open_  # a copy


def test_disable_additional_properties_keeps_to_the_listed_keys(llm):
    """vLLM's `disable_additional_properties`: an object schema that does not forbid other
    keys gets only its own (without it, SmolLM2 goes on adding keys of its own)."""
    schema = {k: v for k, v in SCHEMAS["object"].items() if k != "additionalProperties"}
    so = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert so.key() != StructuredOutputsParams(json=schema).key()  # compiled apart
    for temperature in (0.0, 0.8):
        n = 1 if temperature == 0 else 2
        params = SamplingParams(max_tokens=160, temperature=temperature, seed=5, n=n, structured_outputs=so)
        (out,) = llm.generate([PROMPT], params)
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMAS["object"])  # the closed schema


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t),
        ),
        (
            StructuredOutputsParams(choice=["Paris", "London", "Rome"]),
            lambda t: t in {"Paris", "London", "Rome"},
        ),
        (StructuredOutputsParams(grammar='root ::= "yes" | "no"'), lambda t: t in {"yes", "no"}),
        (StructuredOutputsParams(grammar='start: "a"+ "b"'), lambda t: re.fullmatch("a+b", t)),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for so, holds in cases:
        for temperature in (0.0, 0.7):
            params = SamplingParams(max_tokens=64, temperature=temperature, seed=1, structured_outputs=so)
            (out,) = llm.generate(["The capital of France is"], params)
            assert holds(out.outputs[0].text), (so, out.outputs[0].text)


def test_free_requests_beside_constrained_ones_are_unchanged(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Rain falls when"], free)[0].outputs[0].token_ids
    mixed = llm.generate(["Rain falls when", PROMPT], [free, _json(SCHEMAS["nested"], temperature=0)])
    assert mixed[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["nested"])


def test_preempted_and_recomputed_requests_keep_their_grammar(smollm2_path, llm):
    names = ["nested", "ref", "array_of_objects", "nested", "ref", "array_of_objects"]
    params = [_json(SCHEMAS[n], temperature=0) for n in names]
    want = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * len(names), params)]
    tight = LLM(
        model=str(smollm2_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 * 737_280
    )
    outs = tight.generate([PROMPT] * len(names), params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want


def test_a_resumed_request_replays_its_grammar(llm):
    """A migrated request: its grammar consumes the tokens made elsewhere, then goes on
    exactly as the undisturbed run; tokens the grammar refuses are an error."""
    params = _json(SCHEMAS["ref"], temperature=0)
    (whole,) = llm.generate([PROMPT], params)
    tokens = whole.outputs[0].token_ids
    engine = llm.engine
    engine.add_request("resumed", PROMPT, params, generated_token_ids=tokens[:9])
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == "resumed"), final)
    assert final.outputs[0].token_ids == tokens
    refused = llm.tokenizer("Hello there").input_ids
    with pytest.raises(InvalidArgumentError, match="generated_token_ids"):
        engine.add_request("refused", PROMPT, params, generated_token_ids=refused)
    assert not engine.has_unfinished_requests() and "refused" not in engine.outputs.tracked


def test_a_grammar_that_does_not_compile_names_the_field(llm):
    bad = [
        (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
        (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
    ]
    for so, field in bad:
        with pytest.raises(InvalidArgumentError, match=re.escape(field)):
            llm.generate(["x"], SamplingParams(structured_outputs=so))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidArgumentError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidArgumentError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # a dict, not the params


def test_min_tokens_suppresses_stop_tokens_and_logit_bias_moves_greedy(llm):
    token = llm.tokenizer(" banana").input_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=4, logit_bias={token: 100.0})
    assert llm.generate(["I like"], forced)[0].outputs[0].token_ids == [token] * 4
    # the forced token is also a stop token: without min_tokens it ends the request at once
    stops = SamplingParams(temperature=0, max_tokens=4, logit_bias={token: 100.0}, stop_token_ids=[token])
    assert llm.generate(["I like"], stops)[0].outputs[0].token_ids == [token]
    held = SamplingParams(
        temperature=0, max_tokens=4, min_tokens=3, logit_bias={token: 100.0}, stop_token_ids=[token]
    )
    ids = llm.generate(["I like"], held)[0].outputs[0].token_ids
    assert token not in ids[:3] and ids[3:] == [token]
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        SamplingParams(logit_bias={token: 101.0})


def test_async_engine_compiles_off_the_loop_and_fails_in_the_caller(smollm2_path):
    llm = AsyncLLM(EngineConfig(model=str(smollm2_path), dtype="float32", max_model_len=256))

    async def go():
        with pytest.raises(InvalidArgumentError, match="structured_outputs.regex"):
            await llm.add_request(
                "bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))
            )
        final = None
        async for final in llm.generate(  # noqa: B007 (keep the last)
            "x",
            SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        ):  # noqa: B007
            pass
        return final.outputs[0].text

    try:
        assert asyncio.run(go()) in {"yes", "no"}
    finally:
        llm.shutdown()


def test_json_is_compact_by_default_and_free_whitespace_is_an_option(llm):
    """StructuredOutputsParams' default (disable_any_whitespace): the grammar takes JSON as
    json.dumps writes it and nothing else between tokens; `disable_any_whitespace=False`
    takes any whitespace there. Checked token by token against the compiled grammar."""
    from structured_schemas import compact

    engine = llm.engine
    schema = SCHEMAS["object"]

    def takes(so: StructuredOutputsParams, text: str) -> bool:
        ids = engine.tokenizer(text, add_special_tokens=False).input_ids
        matcher = engine.grammars.matcher(so)
        return (
            matcher.num_valid(ids) == len(ids)
            and all(matcher.accept(t) for t in ids)
            and matcher.is_terminated
        )

    tight, free = (
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(json=schema, disable_any_whitespace=False),
    )
    spaced, bare, pretty = (
        '{"name": "Ann", "age": 7}',
        '{"name":"Ann","age":7}',
        '{\n  "name": "Ann",\n  "age": 7\n}',
    )
    assert compact(spaced) and not compact(bare.replace(",", ",  ")) and not compact(pretty)
    assert takes(tight, spaced) and not takes(tight, bare) and not takes(tight, pretty)
    assert takes(free, spaced) and takes(free, bare) and takes(free, pretty)
    # sampled: every answer compact
    params = SamplingParams(max_tokens=160, temperature=0.9, seed=3, n=4, structured_outputs=tight)
    for c in llm.generate([PROMPT], params)[0].outputs:
        assert c.finish_reason == "stop" and compact(c.text), c.text
        jsonschema.validate(json.loads(c.text), schema)
