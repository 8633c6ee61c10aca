"""N-gram speculation in the engine on the real SmolLM2: greedy tokens identical to plain
decoding (the reference; plain decoding is checked against transformers elsewhere) on
grounded prompts, where most drafts are kept, and open-ended ones, where most are
rejected; with stop strings, penalties, min_tokens, logprobs, structured outputs, n > 1,
chunked prefill, prefix hits and preemption; and no block leaked after any of it.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import assert_no_leaks
from structured_schemas import SCHEMAS

from kvray.engine import LLM, SamplingParams, StructuredOutputsParams
from kvray.errors import InvalidArgumentError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

GROUNDED = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "# The same functions with type hints:\n",
    "Text: Marie Curie was born in Warsaw in 1867 and won two Nobel Prizes.\n"
    "Question: Where was Marie Curie born, and when?\nAnswer: Marie Curie was born in",
    "Copy the list: apples, pears, plums, cherries, grapes, lemons.\nCopy: apples, pears,",
    "<tr><td>1</td><td>alpha</td></tr>\n<tr><td>2</td><td>beta</td></tr>\n<tr><td>3</td><td>",
]
OPEN_ENDED = [
    "Tell me a story about a dragon who learns to paint.",
    "What is the best way to learn a new language?",
    "Write a haiku about winter mornings.",
]
PROMPTS = GROUNDED + OPEN_ENDED
ARGS = dict(dtype="float32", max_model_len=384, max_num_batched_tokens=64, kv_cache_memory_bytes=96 << 20)


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return LLM(model=str(smollm2_path), **ARGS)


@pytest.fixture(scope="module")
def spec(smollm2_path):
    return LLM(model=str(smollm2_path), speculative_config=NGRAM, **ARGS)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_speculation_gives_plain_decodings_tokens(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    before = spec.engine.spec_stats.num_accepted_tokens
    assert tokens(spec.generate(PROMPTS, params)) == tokens(plain.generate(PROMPTS, params))
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > before  # drafts were kept, not only proposed
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and some were rejected
    assert_no_leaks(spec)


def test_each_prompt_alone_and_open_ended_ones_whose_drafts_mostly_fail(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for prompt in OPEN_ENDED[:2] + GROUNDED[:1]:
        assert tokens(spec.generate([prompt], params)) == tokens(plain.generate([prompt], params))
    assert_no_leaks(spec)


@pytest.mark.parametrize(
    "params",
    [
        dict(stop=[" dog", "return"], include_stop_str_in_output=False),
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
        dict(min_tokens=24, max_tokens=28),
        dict(logprobs=2, max_tokens=16),
        dict(max_tokens=7),
    ],
    ids=["stop", "penalties", "min_tokens", "logprobs", "short"],
)
def test_greedy_speculation_with_sampling_options(plain, spec, params):
    sp = SamplingParams(temperature=0.0, **{"max_tokens": 40, **params})
    want, got = plain.generate(PROMPTS, sp), spec.generate(PROMPTS, sp)
    assert tokens(got) == tokens(want)
    for w, g in zip(want, got):
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if sp.logprobs is not None:
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                assert lw.keys() == lg.keys()
                assert [lg[t].logprob for t in lw] == pytest.approx([lw[t].logprob for t in lw], abs=1e-3)
    assert_no_leaks(spec)


def test_structured_outputs_under_speculation(plain, spec):
    schema = SCHEMAS["object"]
    sp = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    prompt = [
        "Give me a JSON object with a name and an age, twice the same: "
        + json.dumps({"name": "Ann", "age": 30})
    ]
    got = spec.generate(prompt, sp)
    assert tokens(got) == tokens(plain.generate(prompt, sp))
    jsonschema.validate(json.loads(got[0].outputs[0].text), schema)
    assert_no_leaks(spec)


def test_sampled_requests_with_n_samples_finish_and_free_their_blocks(spec):
    sp = SamplingParams(temperature=0.8, top_p=0.95, n=3, max_tokens=24, seed=7)
    outs = spec.generate(GROUNDED[:3], sp)
    for o in outs:
        assert len(o.outputs) == 3 and all(len(c.token_ids) == 24 for c in o.outputs)
        assert all(c.finish_reason == "length" for c in o.outputs)
    assert_no_leaks(spec)


def test_prefix_hits_then_speculation(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    first = spec.generate(GROUNDED[:2], params)
    again = spec.generate(GROUNDED[:2], params)
    assert again[0].num_cached_tokens > 0
    assert tokens(again) == tokens(first) == tokens(plain.generate(GROUNDED[:2], params))
    assert_no_leaks(spec)


def test_preemption_under_speculation_gives_the_same_tokens(plain, smollm2_path):
    """A KV budget of 24 blocks (384 positions) cannot hold 8 sequences of ~100 tokens:
    requests are preempted mid-draft and recomputed."""
    small = LLM(
        model=str(smollm2_path), speculative_config=NGRAM, **{**ARGS, "kv_cache_memory_bytes": 24 * 737280}
    )
    params = SamplingParams(temperature=0.0, max_tokens=48)
    assert tokens(small.generate(PROMPTS, params)) == tokens(plain.generate(PROMPTS, params))
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(small)


def test_abort_mid_speculation_frees_every_block(spec):
    engine = spec.engine
    sp = SamplingParams(temperature=0.0, max_tokens=64)
    for i, prompt in enumerate(GROUNDED):
        engine.add_request(f"abort-{i}", prompt, sp)
    for _ in range(12):
        engine.step()
    assert engine.spec_stats.num_drafts > 0
    engine.abort_request([f"abort-{i}" for i in range(len(GROUNDED))])
    assert not engine.has_unfinished_requests()
    assert_no_leaks(spec)


def test_bad_speculative_config_is_refused_at_construction(smollm2_path):
    with pytest.raises(InvalidArgumentError) as e:
        LLM(
            model=str(smollm2_path),
            speculative_config={"method": "ngram", "num_speculative_tokens": 99},
            **ARGS,
        )
    assert e.value.field == "speculative_config.num_speculative_tokens"
