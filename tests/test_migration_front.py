"""The front moves a request whose worker died mid-stream (Ray-free: fake workers).

A worker that dies after streaming the first token: the front sends the request to
another worker of the pool with the tokens it has, and the client's stream goes on from
the next token. Past `router.migration_limit` moves the request fails, saying why.
"""

from __future__ import annotations

import asyncio

import pytest
from test_serve_metrics import FakeRouter, _Method, _ready

from kvray.actors.messages import Delta, DeltaInfo
from kvray.configs import DeploymentConfig
from kvray.engine import SamplingParams
from kvray.errors import EngineDeadError
from kvray.router.frontend import Frontend, WorkerDiedError


class DyingWorker:
    """Streams the first token of every request, then its stream fails (the actor died)."""

    def __init__(self, worker_id: str):
        self.worker_id, self.role = worker_id, "mixed"
        self.started = asyncio.Event()
        self.requests = []
        self.outputs = _Method(self._outputs)
        self.generate = _Method(self._generate)
        self.abort = _Method(lambda rid: None)

    def _generate(self, req):
        self.requests.append(req)
        self.started.set()
        return _ready(None)

    def _outputs(self, destination):
        async def stream():
            await self.started.wait()
            req = self.requests[-1]
            have = len(req.generated_token_ids)
            yield _ready([Delta(req.request_id, [11 + have], "abc"[have], None, None, None)])
            raise RuntimeError("actor died")  # what a stream of a killed actor raises

        return stream()


class FinishingWorker(DyingWorker):
    """Goes on from the tokens a moved request brings and finishes it (3 tokens in all)."""

    def _outputs(self, destination):
        async def stream():
            while True:
                await self.started.wait()
                self.started.clear()
                req = self.requests[-1]
                have = len(req.generated_token_ids)
                ids = [11 + i for i in range(have, 3)]
                yield _ready([Delta(req.request_id, ids, "abc"[have:], None, "length", None)])

        return stream()


def _run(front: Frontend):
    async def go():
        async for out in front.generate("r0", [1, 2, 3], SamplingParams(max_tokens=3)):  # noqa: B007
            pass
        return out.text, list(out.token_ids), out.finish_reason

    return asyncio.run(go())


def test_a_request_moves_on_and_its_stream_continues():
    dying, finishing = DyingWorker("mixed-0"), FinishingWorker("mixed-1")
    front = Frontend(FakeRouter([dying, finishing]), DeploymentConfig(disaggregated=False), "front-0")
    assert _run(front) == ("abc", [11, 12, 13], "length")
    assert front.stats.snapshot()["count"]["request_migrations"] == 1
    (moved,) = finishing.requests
    assert moved.generated_token_ids == [11] and moved.prompt_token_ids == [1, 2, 3]


def test_past_the_migration_limit_the_request_fails_saying_why():
    workers = [DyingWorker(f"mixed-{i}") for i in range(3)]
    config = DeploymentConfig(disaggregated=False, router={"migration_limit": 1})
    front = Frontend(FakeRouter(workers), config, "front-0")
    with pytest.raises(WorkerDiedError, match="migration_limit is 1") as e:
        _run(front)
    assert e.value.worker_id == "mixed-1"  # the second worker died too
    assert [r.generated_token_ids for r in workers[1].requests] == [[11]]


class FailedEngineWorker(DyingWorker):
    """Streams the first token, then says its engine can no longer serve (a failed step,
    a dead loop, a hung step): the stream itself stays open, as the actor is alive."""

    def _outputs(self, destination):
        async def stream():
            await self.started.wait()
            rid = self.requests[-1].request_id
            yield _ready([Delta(rid, [11], "a", None, None, None)])
            yield _ready(
                [Delta(rid, [], "", None, None, None, DeltaInfo(worker_failed="EngineDeadError: step broke"))]
            )
            await asyncio.Event().wait()
            yield  # never reached

        return stream()


class RefusingWorker(DyingWorker):
    """Its engine failed before the request came: `generate` raises EngineDeadError."""

    def _generate(self, req):
        async def refuse():
            raise EngineDeadError("the engine failed")

        return refuse()


def test_a_worker_whose_engine_failed_hands_its_requests_on():
    failed, finishing = FailedEngineWorker("mixed-0"), FinishingWorker("mixed-1")
    front = Frontend(FakeRouter([failed, finishing]), DeploymentConfig(disaggregated=False), "front-0")
    assert _run(front) == ("abc", [11, 12, 13], "length")  # moved on mid-stream
    assert [r.generated_token_ids for r in finishing.requests] == [[11]]
    refusing, finishing = RefusingWorker("mixed-0"), FinishingWorker("mixed-1")
    front = Frontend(FakeRouter([refusing, finishing]), DeploymentConfig(disaggregated=False), "front-0")
    assert _run(front) == ("abc", [11, 12, 13], "length")  # retried before any output
    assert front.num_retries == 1 and [r.generated_token_ids for r in finishing.requests] == [[]]


def test_a_request_that_fails_on_its_worker_fails_alone_and_is_not_moved():
    from kvray.errors import RequestFailedError

    class ErringWorker(FinishingWorker):
        def _outputs(self, destination):
            async def stream():
                await self.started.wait()
                yield _ready([Delta(self.requests[-1].request_id, [11], "a", None, "error", None)])
                await asyncio.Event().wait()
                yield  # never reached

            return stream()

    erring, other = ErringWorker("mixed-0"), FinishingWorker("mixed-1")
    front = Frontend(FakeRouter([erring, other]), DeploymentConfig(disaggregated=False), "front-0")
    with pytest.raises(RequestFailedError, match="failed on its worker"):
        _run(front)
    assert other.requests == [] and front.stats.snapshot()["count"].get("request_migrations", 0) == 0


class SlowRouter(FakeRouter):
    """A Router that does not answer its first `hangs` calls at all (down, restarting)."""

    def __init__(self, workers, hangs: int):
        super().__init__(workers)
        self.hangs = hangs
        self.calls = 0
        self.route = _Method(self._slow_route)

    def _slow_route(self, role, key=None, exclude=()):
        self.calls += 1
        if self.calls <= self.hangs:
            return asyncio.Event().wait()  # never answers
        return self._route(role, key, exclude)


def test_a_router_that_does_not_answer_is_asked_again_until_the_deadline(monkeypatch):
    """Each call to a Router that is down is given up after ROUTER_CALL_S and asked again;
    a request whose Router never answers ends at its deadline with NoWorkerError (a 503)."""
    from kvray.router import frontend
    from kvray.router.router import NoWorkerError

    monkeypatch.setattr(frontend, "ROUTER_CALL_S", 0.05)
    monkeypatch.setattr(frontend, "ROUTER_WAIT_S", 0.5)
    router = SlowRouter([FinishingWorker("mixed-0")], hangs=3)
    front = Frontend(router, DeploymentConfig(disaggregated=False), "front-0")
    assert _run(front) == ("abc", [11, 12, 13], "length")  # came back: the request ran
    assert router.calls == 4
    front = Frontend(
        SlowRouter([FinishingWorker("m")], hangs=10**6), DeploymentConfig(disaggregated=False), "f"
    )

    async def go():
        async for _ in front.generate("r0", [1, 2, 3], SamplingParams(max_tokens=3), timeout_s=2.0):
            pass

    with pytest.raises(NoWorkerError, match="did not answer"):
        asyncio.run(go())


class SilentWorker(DyingWorker):
    """Accepts requests and streams the first token of each, then nothing more."""

    def __init__(self, worker_id: str, first: bool):
        super().__init__(worker_id)
        self.first = first
        self.aborted = []
        self.abort = _Method(lambda rid: self.aborted.append(rid))

    def _outputs(self, destination):
        async def stream():
            await self.started.wait()
            if self.first:
                yield _ready([Delta(self.requests[-1].request_id, [11], "a", None, None, None)])
            await asyncio.Event().wait()  # forever
            yield  # never reached: makes this an async generator

        return stream()


@pytest.mark.parametrize("first", [False, True], ids=["before-output", "mid-stream"])
def test_a_request_past_its_deadline_is_aborted(first):
    from kvray.router.frontend import RequestTimeoutError

    worker = SilentWorker("mixed-0", first)
    front = Frontend(FakeRouter([worker]), DeploymentConfig(disaggregated=False), "front-0")

    async def go():
        out = None
        async for out in front.generate("r0", [1, 2, 3], SamplingParams(max_tokens=3), timeout_s=0.3):  # noqa: B007
            pass
        return out.text, out.finish_reason

    if first:
        assert asyncio.run(go()) == ("a", "abort")
    else:
        with pytest.raises(RequestTimeoutError, match="deadline"):
            asyncio.run(go())
    assert worker.aborted == ["r0"]  # its blocks are freed there


def test_the_stream_passes_deltas_on_as_deltas():
    """`Frontend.stream` yields what each worker sent, a migration unseen (the next worker
    goes on from the next token; the front alone keeps the tokens so far), and a request
    past its deadline mid-stream ends with an "abort" delta that adds nothing."""
    dying, finishing = DyingWorker("mixed-0"), FinishingWorker("mixed-1")
    front = Frontend(FakeRouter([dying, finishing]), DeploymentConfig(disaggregated=False), "front-0")

    async def deltas(front, **kw):
        return [
            (d.token_ids, d.text, d.finish_reason)
            async for d in front.stream("r0", [1, 2, 3], SamplingParams(max_tokens=3), **kw)
        ]

    assert asyncio.run(deltas(front)) == [([11], "a", None), ([12, 13], "bc", "length")]
    assert finishing.requests[0].generated_token_ids == [11]
    silent = SilentWorker("mixed-0", first=True)
    front = Frontend(FakeRouter([silent]), DeploymentConfig(disaggregated=False), "front-0")
    assert asyncio.run(deltas(front, timeout_s=0.3)) == [([11], "a", None), ([], "", "abort")]
    assert silent.aborted == ["r0"]


def test_a_request_waits_for_a_worker_to_join_its_pool():
    """No live worker at first (one died, Serve is starting its replacement): the request
    waits, then runs on the worker that joined; with too short a deadline it fails."""
    from kvray.router.router import NoWorkerError

    seen = []  # what the front counts as waiting, at each ask

    class EmptyThenOne(FakeRouter):
        def _route(self, role, key=None, exclude=()):
            self.asked = getattr(self, "asked", 0) + 1
            seen.append(dict(front.waiting.get(role, {})))
            if self.asked <= 2:
                return _ready(None)  # the pool has no live worker now
            return super()._route(role, key, exclude)

    front = Frontend(EmptyThenOne([FinishingWorker("mixed-1")]), DeploymentConfig(disaggregated=False), "f")
    assert _run(front) == ("abc", [11, 12, 13], "length")
    assert front.num_waiting == 0 and front.router.asked == 3
    # 1 request of 3 prompt tokens waits from the first refusal until a worker takes it
    assert seen == [{}] + [{"running_requests": 1.0, "queued_prompt_tokens": 3.0}] * 2
    assert front.waiting["mixed"] == {"running_requests": 0.0, "queued_prompt_tokens": 0.0}

    front = Frontend(EmptyThenOne([FinishingWorker("mixed-1")]), DeploymentConfig(disaggregated=False), "f")

    async def short():
        async for _ in front.generate("r1", [1, 2, 3], SamplingParams(max_tokens=3), timeout_s=0.2):
            pass

    with pytest.raises(NoWorkerError, match="deadline"):
        asyncio.run(short())
    assert front.num_waiting == 0


def test_a_pd_request_waiting_for_a_decode_worker_counts_the_prompt_tokens_computed_there():
    """A prompt handed off has its KV pulled by the decode worker: while it waits for one to
    join it counts as a request, not as prompt work; a short prompt prefilled there
    (`router.max_local_prefill_length`) counts its tokens, which the decode pool's
    autoscaling reads."""
    from test_serve_metrics import FakeWorker

    seen = []

    class NoDecoderAtFirst(FakeRouter):
        def _route(self, role, key=None, exclude=()):
            if role == "decode":
                self.refused = getattr(self, "refused", 0) + 1
                seen.append(dict(front.waiting.get(role, {})))
                if self.refused % 2:  # every request's first ask finds the pool empty
                    return _ready(None)
            return super()._route(role, key, exclude)

    config = DeploymentConfig(disaggregated=True, router={"max_local_prefill_length": 3})
    workers = [FakeWorker("prefill-0", "prefill"), FakeWorker("decode-0", "decode")]
    front = Frontend(NoDecoderAtFirst(workers), config, "f")

    async def one(rid, prompt):
        async for out in front.generate(rid, prompt, SamplingParams(max_tokens=3)):  # noqa: B007
            pass
        return out.text

    assert asyncio.run(one("handed-off", [1, 2, 3, 4, 5])) == "abc"
    assert asyncio.run(one("local", [1, 2, 3])) == "abc"
    assert front.stats.snapshot()["count"]["local_prefills"] == 1
    # each request: its first ask finds none (counted from then on), its second a worker
    assert seen == [
        {},
        {"running_requests": 1.0, "queued_prompt_tokens": 0.0},  # handed off: pulled there
        {"running_requests": 0.0, "queued_prompt_tokens": 0.0},
        {"running_requests": 1.0, "queued_prompt_tokens": 3.0},  # prefilled there
    ]


def test_http_errors_of_deadlines_and_missing_workers():
    from kvray.errors import RequestFailedError
    from kvray.router.frontend import RequestTimeoutError
    from kvray.router.ingress_parts import api_error_of as _api_error_of
    from kvray.router.router import NoWorkerError

    late = _api_error_of(RequestTimeoutError("request r passed its deadline"), "cmpl-1")
    assert late.status == 408 and late.body()["error"]["type"] == "timeout_error"
    none = _api_error_of(
        NoWorkerError("no live decode worker; none joined before the request's deadline"), "cmpl-1"
    )
    assert none.status == 503 and int(none.headers["Retry-After"]) > 0
    failed = _api_error_of(RequestFailedError("IndexError: index -100000 is out of bounds"), "cmpl-1")
    body = failed.body()["error"]
    assert failed.status == 500 and body["type"] == "internal_server_error"
    assert "cmpl-1" in body["message"] and "IndexError" not in body["message"]  # the cause stays in the log


def test_prefills_and_starts_refused_before_any_output_are_retried_until_max_retries():
    """One retry rule for both legs (Frontend._attempts): a refused prefill goes to the
    next prefill worker, a refused start to the next worker; after router.max_retries
    refusals the request fails saying which workers it tried."""
    from test_serve_metrics import FakeWorker

    from kvray.router.frontend import NoWorkerError

    class RefusingPrefill(FakeWorker):
        def _prefill(self, req):
            return RefusingWorker._generate(self, req)

    workers = [
        RefusingPrefill("prefill-0", "prefill"),
        FakeWorker("prefill-1", "prefill"),
        FakeWorker("decode-0", "decode"),
    ]
    front = Frontend(FakeRouter(workers), DeploymentConfig(disaggregated=True), "front-0")
    assert _run(front) == ("abc", [11, 12, 13], "length")
    assert front.num_retries == 1

    class Counted(RefusingWorker):
        def _generate(self, req):
            self.requests.append(req)
            return super()._generate(req)

    refusing = [Counted(f"mixed-{i}") for i in range(4)]
    config = DeploymentConfig(disaggregated=False, router={"max_retries": 2})
    front = Frontend(FakeRouter(refusing), config, "front-0")
    with pytest.raises(
        NoWorkerError, match=r"gave up after 3 workers failed: \['mixed-0', 'mixed-1', 'mixed-2'\]"
    ):
        _run(front)
    assert [len(w.requests) for w in refusing] == [1, 1, 1, 0]
