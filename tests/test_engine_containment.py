"""One request fails alone, in the async engine on the real SmolLM2 (no Ray).

While four requests stream (three greedy, one seeded and sampled), poison requests come:
every one that intake can refuse is refused naming its field, and every one that gets
past intake and breaks inside a step (made so by changing it after intake: a test double
of a validation bug) ends alone with finish_reason "error". The four streams finish
token-identical to an undisturbed run, and no block stays used.

Liveness: a step that raises, a loop that dies outside the step and a step that hangs
past `step_timeout_s` each make the engine unhealthy (`check_health` raises, the hook is
told once) and fail its requests with EngineDeadError (a worker's fronts then move them).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvray.engine import AsyncLLM, EngineConfig, SamplingParams, StructuredOutputsParams
from kvray.errors import EngineDeadError, InvalidArgumentError

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Rain falls when"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(3)]
PARAMS.append(SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True))


def _config(path, **extra) -> EngineConfig:
    return EngineConfig(
        model=str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20, **extra
    )


@pytest.fixture(scope="module")
def engine(smollm2_path):
    llm = AsyncLLM(_config(smollm2_path))
    yield llm
    llm.shutdown()


async def _run(llm: AsyncLLM, prompt, params, rid: str):
    final = None
    async for final in llm.generate(prompt, params, request_id=rid):  # noqa: B007 (keep the last)
        pass
    return final.outputs[0]


async def _streams(llm: AsyncLLM, tag: str, disturb) -> list:
    """The four streams, and `disturb()` once they are all running."""
    tasks = [
        asyncio.ensure_future(_run(llm, p, s, f"{tag}-{i}")) for i, (p, s) in enumerate(zip(PROMPTS, PARAMS))
    ]
    while (await llm.stats()).num_running < len(tasks):
        await asyncio.sleep(0.01)
    await disturb()
    return [(o.token_ids, o.text, o.finish_reason) for o in await asyncio.gather(*tasks)]


@pytest.fixture(scope="module")
def undisturbed(engine):
    async def nothing():
        pass

    return asyncio.run(_streams(engine, "clean", nothing))


def _assert_clean(llm: AsyncLLM) -> None:
    stats = asyncio.run(llm.stats())
    assert stats.kv.used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0, stats


INTAKE_POISON = [
    ({"stop_token_ids": [10**9], "min_tokens": 2}, "stop_token_ids"),
    ({"logit_bias": {49152: 5.0}}, "logit_bias"),
    ({"allowed_token_ids": [1, 60000]}, "allowed_token_ids"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
]


def test_intake_refuses_bad_requests_while_others_stream(engine, undisturbed):
    refused = {}

    async def poison():
        for extra, field in INTAKE_POISON:
            with pytest.raises(InvalidArgumentError) as e:
                await engine.add_request(f"bad-{field}", "Hi", SamplingParams(max_tokens=4, **extra))
            refused[field] = e.value.field
        for prompt in ([60000], [-1], [1] * 256):
            with pytest.raises(InvalidArgumentError) as e:
                await engine.add_request("bad-prompt", {"prompt_token_ids": prompt}, SamplingParams())
            refused["prompt"] = e.value.field
        deep: dict = {"type": "string"}
        for _ in range(40):
            deep = {"type": "object", "properties": {"a": deep}}
        for so, field in [
            (StructuredOutputsParams(json=deep), "structured_outputs.json"),
            (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        ]:
            with pytest.raises(InvalidArgumentError) as e:
                await engine.add_request("bad-grammar", "Hi", SamplingParams(structured_outputs=so))
            refused[field] = e.value.field

    assert asyncio.run(_streams(engine, "intake", poison)) == undisturbed
    assert refused == {f: f for f in [*(f for _, f in INTAKE_POISON), "prompt"]} | {
        "structured_outputs.json": "structured_outputs.json",
        "structured_outputs.regex": "structured_outputs.regex",
    }
    _assert_clean(engine)


class _BrokenGrammar:
    """A test double of a grammar matcher that fails in the step (`where`: the mask the
    runner asks for, or the token the engine feeds back)."""

    def __init__(self, real, where: str):
        self.real, self.where = real, where

    def __getattr__(self, name):
        return getattr(self.real, name)

    def token_bitmask(self):
        if self.where == "mask":
            raise RuntimeError("mask broke")
        return self.real.token_bitmask()

    def accept(self, token_id: int) -> bool:
        if self.where == "accept":
            raise RuntimeError("accept broke")
        return self.real.accept(token_id)


def test_a_request_that_breaks_inside_a_step_ends_alone(engine, undisturbed):
    """Past intake, each poison breaks a different part of the step: the batched sampler
    (a stop token out of the vocabulary before min_tokens, a logit bias past it), the
    grammar's mask, the grammar's advance. Each ends with "error"; the rest go on."""
    ended = {}

    async def poison_one(name: str, params: SamplingParams, corrupt):
        stream = await engine.add_request(f"poison-{name}", "Tell me a story", params)
        await engine.call(corrupt, f"poison-{name}")
        async for out in stream:
            final = out
        ended[name] = final.outputs[0].finish_reason

    def set_params(**changes):
        def corrupt(rid):
            p = engine.engine.scheduler.requests[rid].sampling_params
            for k, v in changes.items():
                setattr(p, k, v)
            p.stop_token_set = frozenset(p.stop_token_ids)

        return corrupt

    def break_grammar(where):
        def corrupt(rid):
            req = engine.engine.scheduler.requests[rid]
            req.grammar = _BrokenGrammar(req.grammar, where)

        return corrupt

    choice = StructuredOutputsParams(choice=["a long answer here", "another long answer"])  # many tokens

    async def poison():
        await asyncio.gather(
            poison_one(
                "stop", SamplingParams(max_tokens=8, min_tokens=4), set_params(stop_token_ids=[-100000])
            ),
            poison_one(
                "bias", SamplingParams(max_tokens=8, temperature=0.7), set_params(logit_bias={10**9: 1.0})
            ),
            poison_one(
                "mask",
                SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
                break_grammar("mask"),
            ),
            poison_one(
                "accept",
                SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
                break_grammar("accept"),
            ),
        )

    assert asyncio.run(_streams(engine, "step", poison)) == undisturbed
    assert ended == {"stop": "error", "bias": "error", "mask": "error", "accept": "error"}
    assert engine.error is None
    engine.check_health()
    _assert_clean(engine)


# ---- liveness ---------------------------------------------------------------------------


def _fail_streams(llm: AsyncLLM, break_it) -> list[BaseException]:
    """Start two streams, break the engine, return what each stream raised."""

    async def one(i):
        try:
            async for _ in llm.generate(PROMPTS[i], PARAMS[i], request_id=f"live-{i}"):
                pass
        except BaseException as e:  # noqa: BLE001 (what it raised is the result)
            return e
        return None

    async def main():
        tasks = [asyncio.ensure_future(one(i)) for i in range(2)]
        while (await llm.stats()).num_running < 2:
            await asyncio.sleep(0.01)
        await llm.call(break_it)
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    return asyncio.run(main())


@pytest.mark.parametrize("where", ["step", "loop"])
def test_a_failed_step_or_a_dead_loop_fails_the_engine_over(smollm2_path, where):
    told: list[BaseException] = []
    llm = AsyncLLM(_config(smollm2_path), on_failure=told.append)
    try:
        engine = llm.engine

        def break_it():
            def broken(*args):
                raise RuntimeError(f"{where} broke")

            if where == "step":
                engine.runner.execute = broken  # the forward pass fails
            else:
                engine.has_unfinished_requests = broken  # the loop's own work (step() never calls it)

        errors = _fail_streams(llm, break_it)
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert len(told) == 1 and f"{where} broke" in str(told[0])
        with pytest.raises(EngineDeadError):
            llm.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(llm.add_request("after", "Hi", SamplingParams(max_tokens=2)))
        llm.abort("after")  # nothing to abort: no error either
    finally:
        llm.shutdown()


def test_a_step_that_hangs_past_the_timeout_fails_the_engine_over(smollm2_path):
    told: list[tuple[BaseException, str]] = []
    llm = AsyncLLM(
        _config(smollm2_path), on_failure=lambda e: told.append((e, threading.current_thread().name))
    )
    release = threading.Event()
    try:
        engine = llm.engine
        real = engine.runner.execute

        def hanging(*args):
            release.wait(60)
            return real(*args)

        def break_it():  # (the timeout set once the first steps ran: they may build kernels)
            llm.step_timeout_s = 1.0
            engine.runner.execute = hanging

        start = time.monotonic()
        errors = _fail_streams(llm, break_it)
        assert time.monotonic() - start < 20
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert "step_timeout_s=1" in str(errors[0])
        assert len(told) == 1 and told[0][1] == "kvray-engine-watchdog"
        with pytest.raises(EngineDeadError):
            llm.check_health()
    finally:
        release.set()
        llm.shutdown()


def test_a_row_failing_beside_speculative_drafts_ends_alone(smollm2_path):
    """With ngram speculation the others' drafts are verified as usual (greedy: exactly
    plain decoding's tokens) while the broken request ends with "error"."""
    from kvray.engine import LLMEngine

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    engine = LLMEngine(_config(smollm2_path, speculative_config=spec))
    prompts = ["one two three four, one two three four, one two three", "a b c d e a b c d e a b c"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(poison: bool) -> dict:
        for i, p in enumerate(prompts):
            engine.add_request(f"{poison}-{i}", p, greedy)
        if poison:  # broken once it decodes with drafts: its failing step verifies drafts
            engine.add_request("poison", prompts[0], SamplingParams(temperature=0.0, max_tokens=24))
        finals = {}
        while engine.has_unfinished_requests():
            req = engine.scheduler.requests.get("poison")
            if req is not None and req.num_output_tokens >= 4:
                req.sampling_params.logit_bias = {10**9: 1.0}
            for out in engine.step():
                if out.finished:
                    finals[out.request_id.split("-")[-1]] = out.outputs[0]
        return {k: (v.token_ids, v.finish_reason) for k, v in finals.items()}

    clean = run(False)
    disturbed = run(True)
    assert disturbed.pop("poison")[1] == "error"
    assert disturbed == clean
    assert engine.spec_stats.num_drafts > 0  # drafts were verified meanwhile
    assert engine.kv_cache_stats().used_blocks == 0
