"""RequestOutputKind on the real SmolLM2: DELTA pieces add up to the CUMULATIVE outputs,
FINAL_ONLY gives one output per request, the decode side's first token is an output.

The engine is stepped by hand, so every output is seen. The reference is always the
same request run CUMULATIVE on the same engine; stop strings are picked from a greedy
run's own tokens, so they land where each case says (first token, mid text, across
two tokens, inside multi-byte characters).
"""

from __future__ import annotations

import itertools

import pytest
from conftest import assert_no_leaks

from kvray.engine import (
    CompletionOutput,
    EngineConfig,
    LLMEngine,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from kvray.errors import InvalidArgumentError

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind
FRANCE = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: ..."
JAPANESE = "Say hello in Japanese:"  # greedy: Japanese characters split across tokens
_ids = itertools.count()


class _Harness:
    """`assert_no_leaks` wants an `LLM`-like object: the engine and its stats."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def kv_cache_stats(self):
        return self.engine.kv_cache_stats()


@pytest.fixture(scope="module")
def engine(engine_args):
    return LLMEngine(EngineConfig(**engine_args))


def run(engine: LLMEngine, prompt, params: SamplingParams, abort_after: int | None = None):
    """Add one request and step until it is done (or abort it after `abort_after` steps);
    returns every output it produced, in order."""
    rid = f"r{next(_ids)}"
    engine.add_request(rid, prompt, params)
    outs: list[RequestOutput] = []
    steps = 0
    while engine.has_unfinished_requests():
        if steps == abort_after:
            outs += engine.abort_request([rid])
            continue
        outs += engine.step()
        steps += 1
    assert all(o.request_id == rid for o in outs)
    assert_no_leaks(_Harness(engine))
    return outs


def joined(outs: list[RequestOutput]) -> dict[int, CompletionOutput]:
    """Each sample's DELTA pieces put together into one CompletionOutput."""
    acc: dict[int, CompletionOutput] = {}
    for out in outs:
        for c in out.outputs:
            a = acc.setdefault(c.index, CompletionOutput(c.index, "", []))
            assert a.finish_reason is None, "a sample was sent again after it finished"
            a.text += c.text
            a.token_ids += c.token_ids
            if c.logprobs is not None:
                a.logprobs = (a.logprobs or []) + c.logprobs
            a.cumulative_logprob, a.finish_reason, a.stop_reason = (
                c.cumulative_logprob,
                c.finish_reason,
                c.stop_reason,
            )
    return acc


def check_delta_equals_cumulative(engine, prompt, abort_after=None, **kw) -> tuple[list, RequestOutput]:
    """Run the request CUMULATIVE and DELTA; the DELTA pieces must add up to the final
    CUMULATIVE output exactly. Returns (DELTA outputs, final CUMULATIVE output)."""
    final = run(engine, prompt, SamplingParams(**kw), abort_after)[-1]
    deltas = run(engine, prompt, SamplingParams(output_kind=DELTA, **kw), abort_after)
    assert final.finished and deltas[-1].finished
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    assert joined(deltas) == {c.index: c for c in final.outputs}
    # the prompt travels once, on the first output
    assert deltas[0].prompt == final.prompt and deltas[0].prompt_token_ids == final.prompt_token_ids
    assert all(o.prompt is None and o.prompt_token_ids is None for o in deltas[1:])
    assert all(o.metrics is not None for o in deltas)
    return deltas, final


@pytest.fixture(scope="module")
def greedy(engine):
    """Each prompt's greedy CUMULATIVE output and the text of each of its tokens."""
    runs = {}
    for prompt in (FRANCE, JAPANESE):
        out = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=16))[-1].outputs[0]
        runs[prompt] = out, [engine.tokenizer.decode([t]) for t in out.token_ids]
    return runs


def _stop_case(name: str, text: str, pieces: list[str]) -> tuple[str, str]:
    """(stop string, where it must start in the text) for the named case."""
    if name == "first-token":  # the first generated token's own text
        return pieces[0], 0
    if name == "from-first-token-long":  # longer than the text for several tokens
        return "".join(pieces[:5]), 0
    if name == "mid-text":
        stop = pieces[5].strip()
        return stop, text.index(stop)
    if name == "two-tokens":  # the end of token 5 and the start of token 6
        stop = pieces[5][-2:] + pieces[6][:2]
        assert stop not in "".join(pieces[:6]) and stop in "".join(pieces[:7])
        return stop, text.index(stop)
    if name == "multi-byte":  # two Japanese characters, their bytes over several tokens
        stop = text[3:5]
        assert all(ord(ch) > 127 for ch in stop) and not any(stop in p for p in pieces)
        return stop, text.index(stop)
    raise AssertionError(name)


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include-stop"])
@pytest.mark.parametrize(
    ("prompt", "case"),
    [
        (FRANCE, "first-token"),
        (FRANCE, "from-first-token-long"),
        (FRANCE, "mid-text"),
        (FRANCE, "two-tokens"),
        (JAPANESE, "multi-byte"),
    ],
)
def test_delta_with_stop_strings_adds_up_to_cumulative(engine, greedy, prompt, case, include):
    full, pieces = greedy[prompt]
    stop, at = _stop_case(case, full.text, pieces)
    kw = dict(temperature=0.0, max_tokens=16, logprobs=2, stop=[stop], include_stop_str_in_output=include)
    deltas, final = check_delta_equals_cumulative(engine, prompt, **kw)
    got = final.outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop  # the stop really fired
    assert got.text == full.text[: at + len(stop) if include else at]
    assert len(got.logprobs) == len(got.token_ids) and len(got.logprobs[0]) == 2
    if len(got.token_ids) > 1:
        assert len(deltas) == len(got.token_ids)  # streamed: one piece per step


@pytest.mark.parametrize("prompt", [FRANCE, JAPANESE])
def test_delta_without_stop_adds_up_to_cumulative(engine, greedy, prompt):
    deltas, final = check_delta_equals_cumulative(engine, prompt, temperature=0.0, max_tokens=16, logprobs=2)
    assert final.outputs[0].text == greedy[prompt][0].text
    assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * 16
    if prompt == JAPANESE:  # some pieces end inside a character: no text for them yet
        assert any(o.outputs[0].text == "" for o in deltas)
        assert all("\ufffd" not in o.outputs[0].text for o in deltas)


def test_delta_without_logprobs_has_none(engine):
    deltas, _ = check_delta_equals_cumulative(engine, FRANCE, temperature=0.0, max_tokens=4)
    assert all(c.logprobs is None and c.cumulative_logprob is None for o in deltas for c in o.outputs)


def test_delta_n2_sends_only_samples_with_news(engine):
    base = dict(n=2, temperature=1.0, seed=7, max_tokens=12, logprobs=2)
    free = run(engine, FRANCE, SamplingParams(**base))[-1].outputs
    # a token of sample 0 that sample 1 never draws: stopping on it ends sample 0 early
    tok = next(t for t in free[0].token_ids[:6] if t not in free[1].token_ids)
    deltas, final = check_delta_equals_cumulative(engine, FRANCE, stop_token_ids=[tok], **base)
    first, second = final.outputs
    assert first.stop_reason == tok and second.finish_reason == "length"
    assert second.token_ids == free[1].token_ids  # the other sample ran on unchanged
    indexes = [[c.index for c in o.outputs] for o in deltas]
    assert [0, 1] in indexes and indexes[-1] == [1]  # sample 0 left once it finished
    assert all(c.token_ids or c.text or c.finish_reason for o in deltas for c in o.outputs)


@pytest.mark.parametrize("stop", [None, ["zzzz"]], ids=["no-stop", "held-back"])
def test_delta_abort_midway_adds_up_to_cumulative(engine, stop):
    kw = dict(temperature=0.0, max_tokens=24, logprobs=2, stop=stop)
    deltas, final = check_delta_equals_cumulative(engine, FRANCE, abort_after=5, **kw)
    got = final.outputs[0]
    assert got.finish_reason == "abort" and len(got.token_ids) == 5
    last = deltas[-1].outputs[0]
    assert last.token_ids == [] and last.finish_reason == "abort"
    if stop:  # the text held back for a possible "zzzz" comes with the abort
        assert len(last.text) == 3


def test_final_only_gives_one_output_equal_to_cumulative(engine):
    kw = dict(temperature=1.0, seed=3, n=2, max_tokens=10, logprobs=2, stop=[" the"])
    want = run(engine, FRANCE, SamplingParams(**kw))[-1]
    (got,) = run(engine, FRANCE, SamplingParams(output_kind=FINAL_ONLY, **kw))
    assert got.finished and got.outputs == want.outputs
    assert (got.prompt, got.prompt_token_ids) == (want.prompt, want.prompt_token_ids)
    assert got.metrics is not None and got.metrics.time_in_queue is not None


def test_final_only_abort_gives_one_output(engine):
    kw = dict(temperature=0.0, max_tokens=24)
    want = run(engine, FRANCE, SamplingParams(**kw), abort_after=4)[-1]
    (got,) = run(engine, FRANCE, SamplingParams(output_kind=FINAL_ONLY, **kw), abort_after=4)
    assert got.outputs == want.outputs and got.outputs[0].finish_reason == "abort"


# ---- the decode side of disaggregation: the first token is an output ------------------


def decode_side(engine: LLMEngine, prompt, params: SamplingParams, first_token: int) -> list[RequestOutput]:
    """Continue a request as a decode worker does, its KV recomputed here (a failed pull)."""
    rid = f"d{next(_ids)}"
    blocks = engine.add_prefilled_request(rid, prompt, params, first_token)
    outs = engine.take_pending_outputs()  # what the stream gets before any step
    if blocks is not None:
        engine.finish_kv_pull(rid, ok=False)
    while engine.has_unfinished_requests():
        outs += engine.step()
    outs += engine.step()  # outputs made between steps
    assert_no_leaks(_Harness(engine))
    return [o for o in outs if o.request_id == rid]


@pytest.mark.parametrize("stop", [None, [" Paris."]], ids=["no-stop", "stop-after-first"])
@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_decode_side_streams_the_first_token_under_the_same_rules(engine, greedy, stop, kind):
    full, _ = greedy[FRANCE]
    kw = dict(temperature=0.0, max_tokens=16, stop=stop)
    want = run(engine, FRANCE, SamplingParams(**kw))[-1]
    outs = decode_side(engine, FRANCE, SamplingParams(output_kind=kind, **kw), full.token_ids[0])
    assert outs[0].outputs[0].token_ids == full.token_ids[:1] and not outs[0].finished
    assert outs[0].outputs[0].text == ("" if stop else " Paris")  # " Paris" may begin " Paris."
    got = joined(outs)[0] if kind is DELTA else outs[-1].outputs[0]
    assert got == want.outputs[0]


def test_decode_side_first_token_that_stops_is_the_only_output(engine, greedy):
    full, pieces = greedy[FRANCE]
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[pieces[0]], output_kind=DELTA)
    (out,) = decode_side(engine, FRANCE, params, full.token_ids[0])
    assert out.finished and out.outputs[0].text == "" and out.outputs[0].stop_reason == pieces[0]


def test_decode_side_final_only_waits_for_the_end(engine, greedy):
    full, _ = greedy[FRANCE]
    params = SamplingParams(temperature=0.0, max_tokens=16, output_kind=FINAL_ONLY)
    (out,) = decode_side(engine, FRANCE, params, full.token_ids[0])
    assert out.finished and out.outputs[0] == full


def test_decode_side_abort_before_a_step_keeps_the_first_piece(engine, greedy):
    full, _ = greedy[FRANCE]
    rid = f"d{next(_ids)}"
    params = SamplingParams(temperature=0.0, max_tokens=16, output_kind=DELTA)
    blocks = engine.add_prefilled_request(rid, FRANCE, params, full.token_ids[0])
    outs = engine.abort_request([rid])  # the pending first piece comes before the final one
    engine.finish_kv_pull(rid, ok=False)
    assert blocks is not None and not engine.pending_outputs
    assert [o.finished for o in outs] == [False, True]
    assert joined(outs)[0].token_ids == full.token_ids[:1] and joined(outs)[0].text == " Paris"
    assert_no_leaks(_Harness(engine))


def test_output_kind_must_be_the_enum():
    assert SamplingParams().output_kind is CUMULATIVE
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(output_kind="delta")
    assert e.value.field == "output_kind" and "DELTA" in e.value.allowed
    with pytest.raises(InvalidArgumentError):
        SamplingParams(output_kind=1)
