"""The Serve app's own metrics, without Ray: queue time (scheduler -> RequestOutput -> the
front), the request metrics a front records from its workers' deltas, their merge over
ingress replicas, and the per-pull `kvray:kv_transfer_seconds` histogram.

The Frontend runs in-process against fake Router and worker handles (`handle.method.remote(...)`
returns what a Ray handle's await would give), so every number is hand-checkable.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvray.actors.messages import TRANSFER_BUCKETS, Delta, DeltaInfo, PrefillResult, WorkerStats
from kvray.configs import DeploymentConfig
from kvray.engine import RequestOutput, SamplingParams
from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.output_processor import OutputProcessor
from kvray.engine.request import Request
from kvray.engine.scheduler import Scheduler
from kvray.engine.spec_decode import SpecDecodeStats
from kvray.router import metrics
from kvray.router.frontend import Frontend

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
    sched.update_from_output(out, {r.request_id: [7] for i, r in enumerate(out.requests) if out.samples(i)})


def test_first_schedule_ends_the_queue_time_and_a_preemption_keeps_it(monkeypatch):
    # 3 blocks. t=10: A's prompt (1 block; max_num_seqs=1 keeps B waiting). t=20: A's first
    # decode takes a 2nd block, B's prompt the 3rd. t=30: B's first decode needs a 4th: B,
    # the lowest ranked, is preempted and will recompute
    sched = Scheduler(KVCacheManager(num_blocks=3, block_size=BS), 1, 64, 1024)
    a, b = _request("a", arrival=1.0), _request("b", arrival=2.0, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    _clock(monkeypatch, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0)  # each step: schedule, update
    _step(sched)
    assert (a.first_scheduled_time, b.first_scheduled_time) == (10.0, None)
    sched.max_num_seqs = 2
    _step(sched)
    assert b.first_scheduled_time == 20.0
    _step(sched)
    assert b.num_preemptions == 1 and b in sched.waiting
    assert (a.first_scheduled_time, b.first_scheduled_time) == (10.0, 20.0)


def test_first_and_latest_token_times_bound_the_decode_time(monkeypatch, smollm2_tokenizer):
    # t=10/11: A's prompt is scheduled, its first token comes; t=20/21 and 30/31: 2 more
    sched = Scheduler(KVCacheManager(num_blocks=8, block_size=BS), 1, 64, 1024)
    processor = OutputProcessor(smollm2_tokenizer)
    a = _request("a#0", arrival=1.0)
    processor.add("a", [a])
    sched.add_request(a)
    _clock(monkeypatch, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0)
    _step(sched)
    assert (a.first_token_time, a.last_token_time) == (11.0, 11.0)
    _step(sched)
    _step(sched)
    metrics = processor.output("a").metrics
    assert (metrics.first_token_time, metrics.last_token_time, metrics.decode_time) == (11.0, 31.0, 20.0)
    assert a.num_output_tokens == 3


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


# ---- the front: fake router and workers -------------------------------------------------------


class _Method:
    """A fake actor method: `.remote(...)` returns what awaiting or iterating it yields."""

    def __init__(self, fn):
        self.remote = fn

    def options(self, **_):
        return self


async def _ready(value):
    return value


class FakeWorker:
    """Answers like an EngineWorker: three tokens per request, as deltas on its stream; the
    first delta says the engine's queue time, the last what the request cost here."""

    def __init__(self, worker_id: str, role: str, queue_time: float = 0.0, cost: float = 0.0):
        self.worker_id, self.role = worker_id, role
        self.queue_time, self.cost = queue_time, cost
        self.pending: asyncio.Queue = asyncio.Queue()
        self.outputs = _Method(self._outputs)
        self.generate = _Method(lambda req: self._start(req.request_id))
        self.decode = _Method(lambda req, handoff, prefill: self._start(req.request_id))
        self.prefill = _Method(self._prefill)
        self.abort = _Method(lambda rid: _ready(None))
        self.release_kv = _Method(lambda rid: _ready(True))

    def _outputs(self, destination: str):
        async def stream():
            while True:
                yield _ready(await self.pending.get())

        return stream()

    def _start(self, rid: str):
        first = DeltaInfo(queue_seconds=self.queue_time, num_cached_tokens=0)
        self.pending.put_nowait([Delta(rid, [11], "a", None, None, None, first)])
        last = DeltaInfo(cost_usd=self.cost)
        self.pending.put_nowait([Delta(rid, [12, 13], "bc", None, "length", None, last)])
        return _ready(None)

    def _prefill(self, req):
        return _ready(
            PrefillResult(req.request_id, 11, None, None, 0, queue_seconds=self.queue_time, cost_usd=0.5)
        )


class FakeRouter:
    def __init__(self, workers: list[FakeWorker]):
        self.route = _Method(self._route)
        self.workers = workers

    def _route(self, role, key=None, exclude=()):
        w = next(w for w in self.workers if w.role == role and w.worker_id not in exclude)
        return _ready((w.worker_id, w))


def _samples(text: bytes) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


LABELS = (("model_name", MODEL),)


@pytest.mark.parametrize("disaggregated", [False, True])
def test_queue_time_is_observed_once_from_the_engine_that_ran_the_prompt(disaggregated):
    if disaggregated:  # the prefill worker's queue time counts, not the decode worker's
        workers = [FakeWorker("prefill-0", "prefill", 0.5), FakeWorker("decode-0", "decode", 3.0, cost=0.25)]
    else:
        workers = [FakeWorker("mixed-0", "mixed", 0.25, cost=0.25)]
    front = Frontend(FakeRouter(workers), DeploymentConfig(disaggregated=disaggregated), "front-0")

    async def run():
        texts = []
        for i in range(2):
            async for out in front.generate(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=3)):  # noqa: B007 (keep the last)
                pass
            texts.append((out.text, list(out.token_ids), out.finish_reason))
        return texts

    assert asyncio.run(run()) == [("abc", [11, 12, 13], "length")] * 2
    samples = _samples(metrics.render(MODEL, front.stats.snapshot(), []))
    assert samples[("kvray:request_queue_time_seconds_count", LABELS)] == 2
    want = 0.5 if disaggregated else 0.25
    assert samples[("kvray:request_queue_time_seconds_sum", LABELS)] == pytest.approx(2 * want)
    assert samples[("kvray:time_to_first_token_seconds_count", LABELS)] == 2
    assert samples[("kvray:inter_token_latency_seconds_count", LABELS)] == 4  # 2 tokens after the first
    assert samples[("kvray:generation_tokens_total", LABELS)] == 6
    assert samples[("kvray:prompt_tokens_total", LABELS)] == 6
    assert samples[("kvray:request_success_total", (("finished_reason", "length"), *LABELS))] == 2
    # the cost of every worker a request used: prefill's 0.5 + decode's 0.25, or mixed's 0.25
    assert samples[("kvray:request_cost_usd_sum", LABELS)] == pytest.approx(
        2 * (0.75 if disaggregated else 0.25)
    )


def test_fronts_merge_into_one_app_and_counts_add_up():
    a, b = metrics.RequestStats(), metrics.RequestStats()
    a.observe("time_to_first_token_seconds", 0.02)
    b.observe("time_to_first_token_seconds", 3.0)
    b.observe("time_to_first_token_seconds", 0.02)
    for stats, reason in ((a, "stop"), (b, "stop"), (b, "length")):
        stats.finish(metrics.RequestTimer(stats, num_prompt_tokens=10), reason)
    merged = metrics.merge([a.snapshot(), b.snapshot()])
    samples = _samples(metrics.render(MODEL, merged, []))
    bucket = "kvray:time_to_first_token_seconds_bucket"
    assert samples[(bucket, (("le", "0.025"), *LABELS))] == 2
    assert samples[(bucket, (("le", "2.5"), *LABELS))] == 2
    assert samples[(bucket, (("le", "+Inf"), *LABELS))] == 3
    assert samples[("kvray:time_to_first_token_seconds_sum", LABELS)] == pytest.approx(3.04)
    assert samples[("kvray:request_success_total", (("finished_reason", "stop"), *LABELS))] == 2
    assert samples[("kvray:request_success_total", (("finished_reason", "length"), *LABELS))] == 1
    assert samples[("kvray:prompt_tokens_total", LABELS)] == 30


def test_each_kv_pull_is_counted_once_in_the_workers_histogram():
    counts = [0] * (len(TRANSFER_BUCKETS) + 1)
    for seconds in (0.004, 0.02, 0.3, 2.0):  # what a worker's KVPuller records
        counts[sum(b < seconds for b in TRANSFER_BUCKETS)] += 1
    stats = WorkerStats(
        "decode-0", "decode", 0, 0, 0.0, 0, 0, 0, kv_transfer_seconds=2.324, kv_pull_buckets=counts
    )
    labels = (("model_name", MODEL), ("role", "decode"), ("worker", "decode-0"))
    for _ in range(2):  # reading twice (two scrapes, two Router replicas) changes nothing
        last = _samples(metrics.render(MODEL, metrics.RequestStats().snapshot(), [stats]))
    assert last[("kvray:kv_transfer_seconds_count", labels)] == 4
    assert last[("kvray:kv_transfer_seconds_sum", labels)] == pytest.approx(2.324)
    for le, count in (("0.005", 1), ("0.5", 3), ("+Inf", 4)):
        assert last[("kvray:kv_transfer_seconds_bucket", tuple(sorted((*labels, ("le", le)))))] == count
    assert not any(name == "kvray:kv_transfer_seconds_total" for name, _ in last)


def test_spec_decode_counters_follow_vllms_names_per_worker():
    spec = SpecDecodeStats()
    spec.record(4, 3)
    spec.record(4, 1)
    stats = WorkerStats("decode-0", "decode", 0, 0, 0.0, 0, 0, 0, 0.0, spec_decode=spec)
    labels = (("model_name", MODEL), ("role", "decode"), ("worker", "decode-0"))
    got = _samples(metrics.render(MODEL, metrics.RequestStats().snapshot(), [stats]))
    assert got[("kvray:spec_decode_num_drafts_total", labels)] == 2
    assert got[("kvray:spec_decode_num_draft_tokens_total", labels)] == 8
    assert got[("kvray:spec_decode_num_accepted_tokens_total", labels)] == 4
    per_pos = "kvray:spec_decode_num_accepted_tokens_per_pos_total"
    for pos, n in enumerate([2, 1, 1, 0]):
        assert got[(per_pos, tuple(sorted((*labels, ("position", str(pos))))))] == n
