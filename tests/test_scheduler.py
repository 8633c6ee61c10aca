"""Scheduler: token budget, chunked prefill, policies, preemption and stop conditions.

No model: `step()` calls schedule(), hands a made-up token to every request whose
`out.samples(i)` is true (what the model runner would sample), then update_from_output().
block_size is 4 and every pool is small enough that block ids can be traced by hand.
"""

from __future__ import annotations

import pytest

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.request import Request, RequestStatus
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.scheduler import Scheduler, SchedulerOutput

BS = 4
EOS = 0
TOKEN = 5  # the "model" samples this unless told otherwise (not EOS)


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks=num_blocks, block_size=BS),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
    )


def make_request(
    rid: str, prompt_len: int, *, first_token: int = 1, arrival: float = 0.0, **params
) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 100)
    extra = {k: params.pop(k) for k in ("priority", "deadline") if k in params}
    return Request(
        request_id=rid,
        # distinct prompts per request (first_token) so prefix hits happen only when wanted
        prompt_token_ids=[first_token + i for i in range(prompt_len)],
        sampling_params=SamplingParams(**params),
        eos_token_ids=frozenset({EOS}),
        block_size=BS,
        arrival_time=arrival,
        **extra,
    )


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, dict]:
    """One engine step; `tokens` overrides the sampled token per request id."""
    tokens = tokens or {}
    out = sched.schedule()
    sampled = {
        r.request_id: [tokens.get(r.request_id, TOKEN)] for i, r in enumerate(out.requests) if out.samples(i)
    }
    sched.update_from_output(out, sampled)
    return out, sampled


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)]


def assert_pool_ok(sched: Scheduler) -> None:
    s = sched.kv.stats()
    assert s.free_blocks + s.cached_free_blocks + s.used_blocks == s.total_blocks
    sched.kv.pool.check_integrity()


def assert_drained(sched: Scheduler) -> None:
    assert not sched.has_unfinished()
    assert sched.kv.stats().used_blocks == 0
    assert_pool_ok(sched)


# ---- chunked prefill and budgets ------------------------------------------------------


def test_chunked_prefill_4_4_2_samples_only_at_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=4)
    req = make_request("a", 10)
    sched.add_request(req)

    chunks, samples = [], []
    for _ in range(3):
        out = sched.schedule()
        chunks.append(scheduled(out))
        samples.append(out.samples(0))
        sampled = {"a": [TOKEN]} if out.samples(0) else {}
        advanced = sched.update_from_output(out, sampled)
        assert advanced == ([req] if sampled else [])
    assert chunks == [[("a", 4)], [("a", 4)], [("a", 2)]]
    assert samples == [False, False, True]
    assert req.num_computed_tokens == 10
    assert req.output_token_ids == [TOKEN]
    # the step after the prompt is a 1-token decode, which samples
    out, sampled = step(sched)
    assert scheduled(out) == [("a", 1)] and sampled == {"a": [TOKEN]}
    assert req.num_computed_tokens == 11
    # 12 tokens held so far -> 3 blocks
    assert sched.kv.block_ids("a") == [0, 1, 2]


def test_token_budget_splits_across_requests_and_chunks_the_last_prompt():
    sched = make_scheduler(max_num_batched_tokens=5)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 3, first_token=10 * (i + 1), arrival=i))
    out, sampled = step(sched)
    assert scheduled(out) == [("a", 3), ("b", 2)]  # c does not fit this step
    assert out.total_tokens == 5
    assert sampled == {"a": [TOKEN]}  # b's prompt is not finished: it samples nothing
    assert [r.request_id for r in sched.waiting] == ["c"]

    out, sampled = step(sched)
    # running first: a's decode (1) and b's last prompt token (1); c gets the 3 left
    assert scheduled(out) == [("a", 1), ("b", 1), ("c", 3)]
    assert sampled == {"a": [TOKEN], "b": [TOKEN], "c": [TOKEN]}


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", 4, first_token=10, arrival=0, max_tokens=1))
    sched.add_request(make_request("b", 4, first_token=20, arrival=1, max_tokens=5))
    sched.add_request(make_request("c", 4, first_token=30, arrival=2, max_tokens=5))
    out, _ = step(sched)
    assert scheduled(out) == [("a", 4), ("b", 4)]
    assert [r.request_id for r in sched.waiting] == ["c"]
    # a finished (max_tokens=1) during that update, which frees a seat for c
    assert sched.requests.get("a") is None
    out, _ = step(sched)
    assert scheduled(out) == [("b", 1), ("c", 4)]


def test_budget_and_seat_limits_hold_in_a_longer_run_and_everything_drains():
    sched = make_scheduler(num_blocks=12, max_num_seqs=3, max_num_batched_tokens=6)
    for i in range(7):
        sched.add_request(
            make_request(f"r{i}", 3 + 2 * i, first_token=100 * (i + 1), arrival=i, max_tokens=1 + i % 3)
        )
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        assert out.total_tokens <= 6
        assert len(out.requests) <= 3
        assert len(sched.running) <= 3
        assert all(n >= 1 for n in out.num_scheduled_tokens)
        assert_pool_ok(sched)
    assert_drained(sched)


def test_decodes_are_scheduled_before_waiting_prompts_even_of_higher_priority():
    sched = make_scheduler(policy="priority")
    a = make_request("a", 4, first_token=10, arrival=0, priority=5)
    sched.add_request(a)
    step(sched)  # a's prompt, then it samples
    b = make_request("b", 6, first_token=20, arrival=1, priority=0)  # ranks above a
    sched.add_request(b)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 6)]


# ---- policies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, specs, expected",
    [
        # (rid, arrival, priority, deadline)
        ("fcfs", [("x", 3.0, 0, None), ("y", 1.0, 0, None), ("z", 2.0, 0, None)], ["y", "z", "x"]),
        # lower priority value first; ties by arrival
        (
            "priority",
            [("x", 1.0, 2, None), ("y", 2.0, 0, None), ("z", 3.0, 2, None), ("w", 4.0, 1, None)],
            ["y", "w", "x", "z"],
        ),
        # earliest deadline first; no deadline goes last; ties by arrival
        (
            "deadline",
            [("x", 1.0, 0, None), ("y", 2.0, 0, 50.0), ("z", 3.0, 0, 10.0), ("w", 4.0, 0, 50.0)],
            ["z", "y", "w", "x"],
        ),
    ],
)
def test_policy_orders_waiting_requests(policy, specs, expected):
    sched = make_scheduler(policy=policy)
    for i, (rid, arrival, priority, deadline) in enumerate(specs):
        sched.add_request(
            make_request(
                rid, 2, first_token=10 * (i + 1), arrival=arrival, priority=priority, deadline=deadline
            )
        )
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == expected


@pytest.mark.parametrize(
    "policy, first",
    [("fcfs", "late_low"), ("priority", "urgent"), ("deadline", "urgent")],
)
def test_with_one_seat_the_top_ranked_request_runs_first(policy, first):
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    sched.add_request(make_request("late_low", 2, first_token=10, arrival=1.0, priority=9, deadline=99.0))
    sched.add_request(make_request("urgent", 2, first_token=20, arrival=2.0, priority=0, deadline=1.0))
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == [first]


# ---- preemption -----------------------------------------------------------------------


def test_preemption_evicts_the_lowest_ranked_running_request_fcfs():
    # 4 blocks; a and b each fill 2 with an 8-token prompt; both then need a third block
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", 8, first_token=10, arrival=0, max_tokens=3)
    b = make_request("b", 8, first_token=20, arrival=1, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 8), ("b", 8)]
    assert sched.kv.block_ids("a") == [0, 1] and sched.kv.block_ids("b") == [2, 3]

    out, _ = step(sched)
    assert out.preempted == [b]  # b arrived later: lowest ranked under fcfs
    assert scheduled(out) == [("a", 1)]
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b in sched.waiting and b not in sched.running
    assert b.output_token_ids == [TOKEN]  # its generated token is kept (recomputed later)
    assert sched.kv.block_ids("b") == []
    assert len(sched.kv.block_ids("a")) == 3
    assert_pool_ok(sched)

    # b cannot come back while a holds 3 of 4 blocks; a finishes after its 3rd token
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1)]
    assert a.status is RequestStatus.FINISHED_LENGTH

    # b is re-admitted: its first prompt block (block 2) survived in the prefix cache
    out, _ = step(sched)
    assert scheduled(out) == [("b", 5)]  # 9 tokens - 4 hit
    assert b.num_computed_tokens == 9
    assert b.num_cached_tokens == 0  # set at its first admission, when nothing was cached
    assert b.output_token_ids == [TOKEN, TOKEN]
    for _ in range(2):
        step(sched)
    assert b.status is RequestStatus.FINISHED_LENGTH
    assert b.num_output_tokens == 3
    assert_drained(sched)


def test_preemption_under_priority_evicts_the_larger_priority_value():
    sched = make_scheduler(num_blocks=4, policy="priority")
    low = make_request("low", 8, first_token=10, arrival=0, priority=5)
    high = make_request("high", 8, first_token=20, arrival=1, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out, _ = step(sched)
    assert [r.request_id for r in out.requests] == ["high", "low"]
    out, _ = step(sched)
    assert out.preempted == [low]  # arrived first, but ranks last
    assert scheduled(out) == [("high", 1)]
    assert low.status is RequestStatus.WAITING and low.num_computed_tokens == 0
    assert_pool_ok(sched)


def test_running_requests_are_reranked_every_step():
    # low is admitted first; high joins later but must decode first and must not be the victim
    sched = make_scheduler(num_blocks=5, policy="priority")
    low = make_request("low", 8, first_token=10, arrival=0, priority=5)
    sched.add_request(low)
    step(sched)  # low: blocks [0, 1], 9 tokens
    high = make_request("high", 7, first_token=20, arrival=1, priority=0)
    sched.add_request(high)
    out, _ = step(sched)
    assert scheduled(out) == [("low", 1), ("high", 7)]  # low decodes (block 2), high gets [3, 4]
    out, _ = step(sched)
    assert scheduled(out) == [("high", 1), ("low", 1)]  # no new blocks needed this step
    out, _ = step(sched)  # high's 9th token needs a 6th block: low is preempted
    assert out.preempted == [low]
    assert scheduled(out) == [("high", 1)]
    assert_pool_ok(sched)


def test_a_request_that_cannot_grow_alone_preempts_itself():
    sched = make_scheduler(num_blocks=2)
    a = make_request("a", 8)
    sched.add_request(a)
    step(sched)
    out, _ = step(sched)  # needs a third block; nobody else to evict
    assert out.preempted == [a]
    assert out.requests == []
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 0
    assert sched.kv.stats().used_blocks == 0
    assert_pool_ok(sched)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=5)
    sched.add_request(make_request("a", 8, first_token=10, arrival=0))
    sched.add_request(make_request("b", 8, first_token=20, arrival=1))
    step(sched)  # a: [0, 1], b: [2, 3], one block free
    # c ranks above b and needs 1 block, which b's preemption will free up
    c = make_request("c", 1, first_token=30, arrival=0.5)
    sched.add_request(c)
    out, _ = step(sched)
    # a takes the last free block; b then needs one too and, ranking last, preempts itself
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r in out.requests] == ["a"]
    assert c.status is RequestStatus.WAITING  # admitted only from the next step on
    out, _ = step(sched)
    assert ("c", 1) in scheduled(out)
    assert_pool_ok(sched)


# ---- finish and abort -----------------------------------------------------------------


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    run = make_request("run", 6, first_token=10, arrival=0)
    wait = make_request("wait", 6, first_token=20, arrival=1)
    sched.add_request(run)
    sched.add_request(wait)
    step(sched)
    assert sched.kv.stats().used_blocks == 2
    aborted = sched.abort(["run", "wait", "unknown"])
    assert aborted == [run, wait]
    assert run.status is RequestStatus.FINISHED_ABORTED
    assert wait.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort(["run"]) == []  # already gone
    assert_drained(sched)
    assert sched.schedule().requests == []


def test_finish_is_idempotent_and_frees_blocks():
    sched = make_scheduler()
    a = make_request("a", 5)
    sched.add_request(a)
    step(sched)
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)  # no effect once finished
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert_drained(sched)


# ---- stop conditions in update_from_output --------------------------------------------


def run_until_finished(sched: Scheduler, req: Request, tokens: list[int]) -> int:
    """Feed `tokens` one per sampling step; returns how many were consumed."""
    sched.add_request(req)
    fed = 0
    while not req.finished:
        assert fed < len(tokens), "request did not finish"
        out = sched.schedule()
        sampled = {}
        if out.samples(0):
            sampled = {req.request_id: [tokens[fed]]}
            fed += 1
        sched.update_from_output(out, sampled)
    return fed


def test_eos_stops_the_request():
    sched = make_scheduler()
    req = make_request("a", 3)
    assert run_until_finished(sched, req, [7, 8, EOS, 9]) == 3
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [7, 8, EOS]
    assert req.stop_reason is None
    assert_drained(sched)


def test_stop_token_id_stops_and_is_the_stop_reason():
    sched = make_scheduler()
    req = make_request("a", 3, stop_token_ids=[42])
    assert run_until_finished(sched, req, [7, 42, 9]) == 2
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 42
    assert_drained(sched)


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    req = make_request("a", 3, max_tokens=3)
    assert run_until_finished(sched, req, [7, 8, 9, 10]) == 3
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [7, 8, 9]
    assert_drained(sched)


def test_ignore_eos_keeps_generating_until_max_tokens():
    sched = make_scheduler()
    req = make_request("a", 3, ignore_eos=True, max_tokens=4)
    assert run_until_finished(sched, req, [EOS, EOS, 7, EOS, 9]) == 4
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [EOS, EOS, 7, EOS]


def test_ignore_eos_still_honours_stop_token_ids():
    sched = make_scheduler()
    req = make_request("a", 3, ignore_eos=True, stop_token_ids=[42])
    assert run_until_finished(sched, req, [EOS, 42, 9]) == 2
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 42


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    sched = make_scheduler()
    req = make_request("a", 3, min_tokens=3, stop_token_ids=[42])
    # EOS at 1, stop token at 2 are ignored; EOS as the 3rd token stops
    assert run_until_finished(sched, req, [EOS, 42, EOS, 9]) == 3
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [EOS, 42, EOS]


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=8)
    req = make_request("a", 6, max_tokens=None)
    assert run_until_finished(sched, req, [7, 8, 9, 10]) == 2  # 6 + 2 == 8
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.num_tokens == 8
    assert_drained(sched)


def test_update_returns_only_requests_that_got_a_token():
    sched = make_scheduler(max_num_batched_tokens=6)
    a = make_request("a", 2, first_token=10, arrival=0)
    b = make_request("b", 9, first_token=20, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert scheduled(out) == [("a", 2), ("b", 4)]
    assert [out.samples(0), out.samples(1)] == [True, False]
    advanced = sched.update_from_output(out, {"a": [7]})
    assert advanced == [a]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (2, 4)
    assert b.output_token_ids == []
