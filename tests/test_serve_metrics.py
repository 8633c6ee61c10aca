"""The Serve app's own metrics, without Ray: queue time (scheduler -> RequestOutput -> router)
and the per-pull `kvray:kv_transfer_seconds` histogram.

The Router runs in-process against fake worker handles (`handle.method.remote(...)` returns
what a Ray handle's await would give), so every number is hand-checkable.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvray.actors.worker import PrefillResult, WorkerStats
from kvray.engine import CompletionOutput, RequestOutput, SamplingParams
from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.output_processor import OutputProcessor
from kvray.engine.outputs import RequestMetrics
from kvray.engine.request import Request
from kvray.engine.scheduler import Scheduler
from kvray.router.router import Router

BS = 4
MODEL = "test-model"


# ---- engine: when a request is first scheduled --------------------------------------------


def _request(rid: str, arrival: float, first_token: int = 1) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[first_token + i for i in range(BS)],  # one full block
        sampling_params=SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
        eos_token_ids=frozenset({0}),
        block_size=BS,
        arrival_time=arrival,
    )


def _clock(monkeypatch, *times: float) -> None:
    ticks = iter(times)
    monkeypatch.setattr("kvray.engine.scheduler.time.monotonic", lambda: next(ticks))


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_from_output(out, {r.request_id: 7 for i, r in enumerate(out.requests) if out.samples(i)})


def test_first_schedule_ends_the_queue_time_and_a_preemption_keeps_it(monkeypatch):
    # 3 blocks. t=10: A's prompt (1 block; max_num_seqs=1 keeps B waiting). t=20: A's first
    # decode takes a 2nd block, B's prompt the 3rd. t=30: B's first decode needs a 4th: B,
    # the lowest ranked, is preempted and will recompute
    sched = Scheduler(KVCacheManager(num_blocks=3, block_size=BS), 1, 64, 1024)
    a, b = _request("a", arrival=1.0), _request("b", arrival=2.0, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    _clock(monkeypatch, 10.0, 20.0, 30.0)
    _step(sched)
    assert (a.first_scheduled_time, b.first_scheduled_time) == (10.0, None)
    sched.max_num_seqs = 2
    _step(sched)
    assert b.first_scheduled_time == 20.0
    _step(sched)
    assert b.num_preemptions == 1 and b in sched.waiting
    assert (a.first_scheduled_time, b.first_scheduled_time) == (10.0, 20.0)


def test_outputs_carry_the_queue_time_of_the_first_scheduled_sample(smollm2_tokenizer):
    processor = OutputProcessor(smollm2_tokenizer)
    samples = [_request("r#0", arrival=5.0), _request("r#1", arrival=5.0)]
    processor.add("r", samples)
    assert processor.output("r").metrics.time_in_queue is None  # not scheduled yet
    samples[1].first_scheduled_time = 9.0
    samples[0].first_scheduled_time = 7.5
    metrics = processor.output("r").metrics
    assert (metrics.arrival_time, metrics.first_scheduled_time, metrics.time_in_queue) == (5.0, 7.5, 2.5)
    assert RequestOutput("x", None, [1], [], finished=False).metrics is None  # optional


# ---- router: fake workers --------------------------------------------------------------------


class _Method:
    """A fake actor method: `.remote(...)` returns what awaiting or iterating it yields."""

    def __init__(self, fn):
        self.remote = fn


async def _ready(value):
    return value


class FakeWorker:
    def __init__(self, worker_id: str, role: str, queue_time: float = 0.0):
        self.worker_id, self.role = worker_id, role
        self.queue_time = queue_time
        self.finished_pulls: list[float] = []  # drained by stats(), as EngineWorker does
        self.stats = _Method(self._stats)
        self.generate = _Method(self._generate)
        self.prefill = _Method(self._prefill)
        self.decode = _Method(self._decode)
        self.abort = _Method(lambda rid: _ready(None))

    async def _stats(self) -> WorkerStats:
        durations, self.finished_pulls = self.finished_pulls, []
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            num_running=0,
            num_waiting=0,
            kv_usage=0.0,
            used_blocks=0,
            pinned=0,
            kv_transfer_bytes=0,
            kv_transfer_seconds=sum(durations),
            kv_pull_durations=durations,
            kv_recomputes=0,
            prefix_queries=0,
            prefix_hits=0,
        )

    def _metrics(self) -> RequestMetrics:
        return RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0 + self.queue_time)

    def _outputs(self, rid: str, tokens: list[int]):
        """Cumulative outputs, one token more each, as refs (awaitables)."""

        async def gen():
            for n in range(1, len(tokens) + 1):
                done = n == len(tokens)
                c = CompletionOutput(0, "", tokens[:n], finish_reason="length" if done else None)
                yield _ready(RequestOutput(rid, None, [1, 2], [c], done, metrics=self._metrics()))

        return gen()

    def _generate(self, rid, prompt, params):
        return self._outputs(rid, [11, 12, 13])

    def _prefill(self, rid, prompt, params):
        handoff = PrefillResult(rid, None, prompt["prompt_token_ids"], 11, None, None, 0)
        handoff.metrics = self._metrics()  # the field PrefillResult carries to the router
        return _ready(handoff)

    def _decode(self, rid, params, handoff, prefill):
        return self._outputs(rid, [11, 12, 13])


def _router(smollm2_path, workers: list[FakeWorker], disaggregated: bool) -> Router:
    config = {"engine": {"model": str(smollm2_path)}, "disaggregated": disaggregated}
    return Router(config, [(w.worker_id, w.role, w) for w in workers], MODEL)


def _samples(text: bytes) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


async def _run(router: Router, rid: str) -> RequestOutput:
    final = None
    async for final in router.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3), rid):  # noqa: B007
        pass
    return final


@pytest.mark.parametrize("disaggregated", [False, True])
def test_queue_time_is_observed_once_from_the_engine_that_ran_the_prompt(smollm2_path, disaggregated):
    if disaggregated:  # the prefill worker's queue time counts, not the decode worker's
        workers = [FakeWorker("prefill-0", "prefill", 0.5), FakeWorker("decode-0", "decode", 3.0)]
    else:
        workers = [FakeWorker("mixed-0", "mixed", 0.25)]
    router = _router(smollm2_path, workers, disaggregated)

    async def run():
        for i in range(2):
            assert (await _run(router, f"r{i}")).finished
        return await router.metrics_text()

    samples = _samples(asyncio.run(run()))
    labels = (("model_name", MODEL),)
    assert samples[("kvray:request_queue_time_seconds_count", labels)] == 2
    want = 0.5 if disaggregated else 0.25
    assert samples[("kvray:request_queue_time_seconds_sum", labels)] == pytest.approx(2 * want)
    assert samples[("kvray:time_to_first_token_seconds_count", labels)] == 2


def test_each_kv_pull_is_observed_once_whoever_reads_the_stats(smollm2_path):
    decode = FakeWorker("decode-0", "decode")
    router = _router(smollm2_path, [FakeWorker("prefill-0", "prefill"), decode], True)

    async def run():
        decode.finished_pulls += [0.004]
        await router.check_health()  # the health loop's read drains it
        decode.finished_pulls += [0.02, 0.3]
        first = await router.metrics_text()
        decode.finished_pulls += [2.0]
        await router.worker_stats()
        return first, await router.metrics_text()

    first, last = (_samples(t) for t in asyncio.run(run()))
    labels = (("model_name", MODEL), ("role", "decode"), ("worker", "decode-0"))
    assert first[("kvray:kv_transfer_seconds_count", labels)] == 3
    assert last[("kvray:kv_transfer_seconds_count", labels)] == 4
    assert last[("kvray:kv_transfer_seconds_sum", labels)] == pytest.approx(2.324)
    for le, count in (("0.005", 1), ("0.5", 3), ("+Inf", 4)):
        assert last[("kvray:kv_transfer_seconds_bucket", tuple(sorted((*labels, ("le", le)))))] == count
    assert not any(name == "kvray:kv_transfer_seconds_total" for name, _ in last)
