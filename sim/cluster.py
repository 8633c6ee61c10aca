"""The discrete-event loop: requests arrive, the router's policy picks workers, workers
step, KV pulls take their time on the link.

Events happen in time order (ties in the order they were made):

    arrive ──▶ route (prefill | mixed) ──▶ worker steps ... first token
      PD:  prefill finished ──(1 hop)▶ the front routes decode ──(1 hop)▶ the decode worker
           takes the first token (──(1 hop)▶ client) and reserves blocks (or waits for
           room between its steps while the prefill's pin lasts, else recomputes) ──▶
           pull (bytes / link) ──▶ pulled: it admits the request, the prefill worker
           unpins ──▶ steps ...

The router sees what kvray's Router sees: load reports taken every `report_interval_s`
(its health period) plus what it has routed since, and it chooses with the same functions
(`kvray.routing`: prefix affinity by rendezvous hashing, least KV usage for decode).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvray.engine.kv_handoff import LeasePolicy
from kvray.engine.request import Request
from kvray.routing import WorkerLoad, choose_decode, choose_prefill, prefix_key
from kvray.sim.cost_model import StepTimeModel
from kvray.sim.results import RequestRecord, SimResult, SLOBudget
from kvray.sim.worker import STAND_IN_TOKEN, Role, SimEngineConfig, SimWorker
from kvray.sim.workload import SimRequest, prompt_token_ids


@dataclass(frozen=True)
class PoolSpec:
    """`num_workers` workers of one role, each a TP group the cost model describes."""

    num_workers: int
    engine: SimEngineConfig
    cost: StepTimeModel

    @property
    def num_gpus(self) -> int:
        return self.num_workers * self.cost.tp


@dataclass(frozen=True)
class ClusterSpec:
    """PD (`prefill` and `decode` pools) or colocated (`mixed` pool)."""

    prefill: PoolSpec | None = None
    decode: PoolSpec | None = None
    mixed: PoolSpec | None = None
    affinity_blocks: int = 4  # RouterConfig's defaults
    imbalance_threshold: int = 4
    max_local_prefill_length: int = 0  # PD: prompts up to this long run whole on a decode worker
    report_interval_s: float = 2.0
    network_s: float = 0.0  # one way, ingress <-> worker, per message (a token's trip)
    # the prefill -> decode link for KV pulls (None: the devices' own link, e.g. NVLink)
    kv_bandwidth: float | None = None  # bytes/s
    kv_latency_s: float | None = None
    # the hand-off's timing: a prefill's ticket lasts `lease_s` from its prompt's end; a
    # decode worker without room waits for some until `pull_margin_s` before that
    lease: LeasePolicy = LeasePolicy()

    def __post_init__(self) -> None:
        if (self.mixed is None) == (self.prefill is None or self.decode is None):
            raise ValueError("a cluster has prefill and decode pools (PD) or a mixed pool (colocated)")

    @property
    def disaggregated(self) -> bool:
        return self.mixed is None

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in (self.prefill, self.decode, self.mixed) if p is not None)

    @property
    def name(self) -> str:
        if self.disaggregated:
            return f"PD {self.prefill.num_workers}:{self.decode.num_workers}"
        return f"colocated x{self.mixed.num_workers}"


class _RouterView:
    """The router's picture of one pool: the load reports of its last health round (every
    `interval_s`, as kvray's Router probes) plus what it has routed since."""

    def __init__(self, workers: list[SimWorker], interval_s: float):
        self.workers = {w.worker_id: w for w in workers}
        self.loads = {w.worker_id: WorkerLoad(w.worker_id) for w in workers}
        self.interval_s = interval_s

    def report(self) -> None:
        for wid, w in self.workers.items():
            load = self.loads[wid]
            load.num_requests, load.kv_usage, load.routed = w.num_requests, w.kv_usage, 0

    def current(self) -> list[WorkerLoad]:
        return list(self.loads.values())

    def pick(self, chosen: WorkerLoad) -> SimWorker:
        chosen.routed += 1
        return self.workers[chosen.worker_id]


class Simulator:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.pools: dict[Role, list[SimWorker]] = {}
        for role in ("prefill", "decode", "mixed"):
            pool: PoolSpec | None = getattr(spec, role)
            if pool is not None:
                self.pools[role] = [
                    SimWorker(
                        f"{role}-{i}", role, pool.engine, pool.cost, clock=self._clock, lease=spec.lease
                    )
                    for i in range(pool.num_workers)
                ]
        self.views = {role: _RouterView(ws, spec.report_interval_s) for role, ws in self.pools.items()}
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.records: dict[str, RequestRecord] = {}
        self.prompts: dict[str, list[int]] = {}
        self.budget: SLOBudget | None = None
        self.unsent: deque[SimRequest] = deque()  # waiting for a client slot (max_concurrency)
        self.kicked: set[str] = set()  # workers with a step start pending now
        self.num_reports = 0  # health rounds in the event queue
        self.link_free: dict[tuple[str, str], float] = {}  # (out|in, worker id) -> when free
        self.pinned_on: dict[str, SimWorker] = {}  # a decode worker's wait or pull -> the prefill worker

    def _clock(self) -> float:
        return self.now

    def _at(self, t: float, fn: Callable, *args, late: bool = False) -> None:
        """Run fn(*args) at time t; `late` ones after every other event of the same time."""
        heapq.heappush(self.events, (t, late, next(self.seq), fn, args))

    def run(
        self,
        requests: Sequence[SimRequest],
        budget: SLOBudget | None = None,
        max_concurrency: int | None = None,
    ) -> SimResult:
        """Every request to its last token (or until `budget` runs out). `max_concurrency`:
        clients that keep at most that many requests in flight, sending the next when one
        finishes (`vllm bench serve --max-concurrency`; latencies count from the send)."""
        self.budget = budget
        entry = self.pools["prefill" if self.spec.disaggregated else "mixed"][0].engine
        for r in requests:
            if r.prompt_len + r.output_len > entry.max_model_len:  # the real engine refuses it too
                raise ValueError(
                    f"{r.request_id}: prompt_len {r.prompt_len} + output_len {r.output_len} "
                    f"exceeds max_model_len {entry.max_model_len}"
                )
        for view in self.views.values():
            self.num_reports += 1
            self._at(0.0, self._report, view)
        for r in requests:
            self.records[r.request_id] = RequestRecord(r.request_id, r.arrival_s, r.prompt_len, r.output_len)
        first = requests if max_concurrency is None else requests[:max_concurrency]
        self.unsent = deque(requests[len(first) :])
        for r in first:
            self._at(r.arrival_s, self._arrive, r)
        gave_up = False
        while self.events:
            t, _, _, fn, args = heapq.heappop(self.events)
            self.now = t
            fn(*args)
            if budget is not None and budget.exhausted:
                gave_up = True
                break
        workers = [w for ws in self.pools.values() for w in ws]
        return SimResult(
            records=[self.records[r.request_id] for r in requests],
            num_gpus=self.spec.num_gpus,
            busy_s={w.worker_id: w.busy_s for w in workers},
            num_preemptions=sum(w.scheduler.num_preemptions for w in workers),
            num_kv_recomputes=sum(w.handoff.num_recomputes for w in workers),
            gave_up=gave_up,
        )

    # ---- events -------------------------------------------------------------------------

    def _arrive(self, r: SimRequest) -> None:
        ids = prompt_token_ids(r)
        handed_off = self.spec.disaggregated and len(ids) > self.spec.max_local_prefill_length
        if handed_off:  # the decode side rebuilds the request from them
            self.prompts[r.request_id] = ids
        role: Role = "prefill" if handed_off else "decode" if self.spec.disaggregated else "mixed"
        view = self.views[role]
        if role == "decode":  # a short prompt, prefilled where it decodes
            worker = view.pick(choose_decode(view.current()))
        else:
            key = prefix_key(ids, self.pools[role][0].engine.block_size, self.spec.affinity_blocks)
            worker = view.pick(choose_prefill(view.current(), key, self.spec.imbalance_threshold))
        max_tokens = 1 if role == "prefill" else r.output_len
        req = worker.new_request(r.request_id, ids, max_tokens, r.arrival_s)
        self._at(self.now + self.spec.network_s, self._enqueue, worker, req)

    def _report(self, view: _RouterView) -> None:
        """A health round; the next one while anything else is still to happen."""
        view.report()
        self.num_reports -= 1
        if len(self.events) > self.num_reports:
            self.num_reports += 1
            self._at(self.now + view.interval_s, self._report, view)

    def _enqueue(self, worker: SimWorker, req: Request) -> None:
        worker.add(req)
        self._kick(worker)

    def _kick(self, worker: SimWorker) -> None:
        """Start the worker's next step once everything else happening now has happened
        (requests arriving at the same moment go into the same step)."""
        if worker.worker_id not in self.kicked:
            self.kicked.add(worker.worker_id)
            self._at(self.now, self._start, worker, late=True)

    def _start(self, worker: SimWorker) -> None:
        """Between two steps, as the engine's loop: the hand-off's turn, then a step."""
        self.kicked.discard(worker.worker_id)
        if worker.stepping:  # its step's end kicks it again
            return
        for rid, blocks in worker.handoff_step():
            if blocks is not None:
                self._pull(worker, rid)
            else:  # recomputed here: the pin goes at once
                self.pinned_on.pop(rid).release_pin(rid)
        seconds = worker.start_step()
        if seconds is not None:
            self._at(self.now + seconds, self._step_done, worker)

    def _step_done(self, worker: SimWorker) -> None:
        n = self.spec.network_s
        for req in worker.finish_step():
            rid = req.request_id
            if worker.role != "prefill":
                self._token(rid)
            elif self.records[rid].output_len == 1:  # the prefill's token is the whole output
                self._token(rid)
                worker.release_pin(rid)
                self.prompts.pop(rid)
            else:  # first token and ticket to the front, which hands both to a decode worker
                self._at(self.now + n, self._hand_off, worker, req, self.now + self.spec.lease.lease_s)
        self._kick(worker)

    def _token(self, request_id: str) -> None:
        record = self.records[request_id]
        record.token_times.append(self.now + self.spec.network_s)
        if self.budget is not None:
            self.budget.on_token(record)
        if record.done and self.unsent:  # a client slot is free: send the next request
            r = self.unsent.popleft()
            if r.arrival_s < record.token_times[-1]:
                r = replace(r, arrival_s=record.token_times[-1])
                self.records[r.request_id].arrival_s = r.arrival_s
            self._at(r.arrival_s, self._arrive, r)

    def _hand_off(self, prefill: SimWorker, done: Request, deadline: float) -> None:
        """At the front: route the decode side and send it the request (and the ticket,
        whose pin lasts until `deadline`)."""
        view = self.views["decode"]
        decode = view.pick(choose_decode(view.current()))
        self._at(self.now + self.spec.network_s, self._admit, prefill, decode, done, deadline)

    def _admit(self, prefill: SimWorker, decode: SimWorker, done: Request, deadline: float) -> None:
        """At the decode worker: it takes the first token (its output goes to the front
        from here, as `add_prefilled_request` makes it) and reserves blocks for the pull,
        or waits for room (at the latest until the pin is about to lapse), or recomputes."""
        rid = done.request_id
        req = decode.new_request(rid, self.prompts.pop(rid), self.records[rid].output_len, done.arrival_time)
        req.append_token(STAND_IN_TOKEN)  # the first token, sampled by the prefill
        self._token(rid)
        self.pinned_on[rid] = prefill
        pin_end = self.spec.lease.pin_end(deadline, self.now)
        admission = decode.reserve_pull(req, pin_end)
        if admission == "pull":
            self._pull(decode, rid)
        elif admission == "wait":  # its wait ends here, if no room came before
            self._at(pin_end - self.spec.lease.pull_margin_s, self._kick, decode)
        else:  # recomputed on the decode worker: the pin goes at once
            self.pinned_on.pop(rid).release_pin(rid)
            self._kick(decode)

    def _pull(self, decode: SimWorker, request_id: str) -> None:
        """Start a pull into the blocks reserved on `decode`."""
        prefill = self.pinned_on[request_id]
        seconds = self.spec.decode.cost.kv_pull_s(
            self.records[request_id].prompt_len, self.spec.kv_bandwidth, self.spec.kv_latency_s
        )
        # a link carries one pull at a time, at its full rate: a pull waits for the
        # prefill worker's way out and the decode worker's way in to both be free
        ends = (("out", prefill.worker_id), ("in", decode.worker_id))
        start = max(self.now, *(self.link_free.get(end, 0.0) for end in ends))
        for end in ends:
            self.link_free[end] = start + seconds
        self._at(start + seconds, self._pulled, prefill, decode, request_id)

    def _pulled(self, prefill: SimWorker, decode: SimWorker, request_id: str) -> None:
        decode.land_pull(request_id)
        del self.pinned_on[request_id]
        prefill.release_pin(request_id)
        self._kick(decode)
        self._kick(prefill)  # blocks came back: a waiting prompt may fit now


def simulate(
    spec: ClusterSpec,
    requests: Sequence[SimRequest],
    budget: SLOBudget | None = None,
    max_concurrency: int | None = None,
) -> SimResult:
    return Simulator(spec).run(requests, budget, max_concurrency)
