"""A request resumed on another engine after its first one died (migration): the new
engine recomputes prompt + the tokens already streamed and goes on from the next token.

Reference: the same request run undisturbed on one engine. Greedy and seeded sampling
must give the same tokens; the resumed request's deltas must continue the undisturbed
stream exactly (text, tokens, finish), stop strings spanning the cut included; and
max_tokens counts the tokens made before the move.
"""

from __future__ import annotations

import pytest

from kvray.engine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from kvray.errors import InvalidArgumentError

PROMPT = "The history of the printing press begins in"


@pytest.fixture(scope="module")
def engine(smollm2_path):
    cfg = EngineConfig(
        model=str(smollm2_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20
    )
    return LLMEngine(cfg)


def _deltas(engine: LLMEngine, rid: str, params: SamplingParams, generated=None) -> list:
    engine.add_request(rid, PROMPT, params, generated_token_ids=generated)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0] for o in engine.step() if o.request_id == rid and o.outputs]
    pieces += [o.outputs[0] for o in engine.step() if o.request_id == rid and o.outputs]
    assert pieces[-1].finish_reason is not None
    return pieces


def _cut(pieces: list, num_tokens: int) -> tuple[list[int], str]:
    """What a front had received after the deltas that carried the first `num_tokens`."""
    ids, text = [], ""
    for p in pieces:
        if len(ids) >= num_tokens:
            break
        ids += p.token_ids
        text += p.text
    return ids, text


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_p": 0.95, "seed": 11},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
    ],
    ids=["greedy", "seeded", "penalties"],
)
@pytest.mark.parametrize("moved_after", [1, 7])
def test_resumed_stream_continues_the_undisturbed_one(engine, sampling, moved_after):
    params = SamplingParams(max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **sampling)
    whole = _deltas(engine, f"whole-{moved_after}", params)
    ids, text = _cut(whole, moved_after)
    rest = _deltas(engine, f"moved-{moved_after}", params, generated=ids)
    assert ids + [t for p in rest for t in p.token_ids] == [t for p in whole for t in p.token_ids]
    assert text + "".join(p.text for p in rest) == "".join(p.text for p in whole)
    assert rest[-1].finish_reason == "length"  # 20 tokens in all, not 20 after the move


def test_stop_string_spanning_the_cut(engine):
    """A stop string whose first characters were held back on the first engine: the
    resumed engine holds the same tail, and the final text is cut where it would be."""
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = _deltas(engine, "free", free)[-1].token_ids
    full = engine.tokenizer.decode(tokens)
    # a stop string made of the end of token 3 and the start of token 4 (reads across them)
    head = engine.tokenizer.decode(tokens[:3])
    stop = full[len(head) - 2 : len(head) + 3]
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=[stop], output_kind=RequestOutputKind.DELTA)
    whole = _deltas(engine, "stop-whole", params)
    ids, text = _cut(whole, 3)
    rest = _deltas(engine, "stop-moved", params, generated=ids)
    assert rest[-1].finish_reason == whole[-1].finish_reason == "stop"
    assert text + "".join(p.text for p in rest) == "".join(p.text for p in whole) == full[: len(head) - 2]


def test_resume_rejects_n_greater_than_one(engine):
    with pytest.raises(InvalidArgumentError, match="n"):
        engine.add_request("n2", PROMPT, SamplingParams(n=2, max_tokens=4), generated_token_ids=[1, 2])
    assert engine.kv_cache_stats().used_blocks == 0
