"""Router policy with hand-checkable loads: prefix affinity by rendezvous hashing, imbalance
override, decode choice, and agreement between Router replicas (no Ray: worker handles are
plain objects that are never called)."""

from __future__ import annotations

import asyncio

from kvray.router.router import Router
from kvray.routing import WorkerLoad, affine_worker, choose_decode, choose_prefill, prefix_key

KEYS = [prefix_key(list(range(i, i + 64)), 16, 4) for i in range(400)]


def test_prefix_key_covers_only_the_leading_full_blocks():
    assert prefix_key(list(range(15)), block_size=16, num_blocks=4) is None
    a = prefix_key(list(range(40)), 16, 2)  # 2 full blocks: tokens 0..31
    assert a == prefix_key(list(range(32)) + [99] * 8, 16, 2)
    assert a != prefix_key([1] + list(range(1, 40)), 16, 2)
    assert prefix_key(list(range(100)), 16, 2) == prefix_key(list(range(32)), 16, 2)


def test_same_prefix_goes_to_the_same_worker_and_prefixes_spread():
    loads = [WorkerLoad("p0"), WorkerLoad("p1"), WorkerLoad("p2")]
    chosen = {}
    for first in range(30):
        key = prefix_key([first] * 16 + [7] * 16, 16, 4)
        w = choose_prefill(loads, key, imbalance_threshold=4)
        assert choose_prefill(loads, prefix_key([first] * 16 + [7] * 16 + [1, 2], 16, 4), 4) is w
        chosen.setdefault(w.worker_id, 0)
        chosen[w.worker_id] += 1
    assert len(chosen) == 3  # 30 different prefixes use every worker


def test_imbalance_overrides_affinity():
    loads = [WorkerLoad("p0"), WorkerLoad("p1")]
    key = next(
        k
        for k in (prefix_key([i] * 16, 16, 1) for i in range(100))
        if choose_prefill(loads, k, 4).worker_id == "p1"
    )
    loads[1].routed = 4  # gap of 4: not beyond the threshold
    assert choose_prefill(loads, key, 4).worker_id == "p1"
    loads[1].num_requests = 1  # gap of 5 > 4: least loaded wins
    assert choose_prefill(loads, key, 4).worker_id == "p0"


def test_no_full_block_goes_to_the_least_loaded():
    loads = [
        WorkerLoad("p0", routed=3),
        WorkerLoad("p1", num_requests=1),
        WorkerLoad("p2", num_requests=1, routed=1),
    ]
    assert choose_prefill(loads, None, 4).worker_id == "p1"


def test_decode_choice_is_least_kv_usage_then_fewest_requests():
    loads = [
        WorkerLoad("d0", kv_usage=0.50, num_requests=1),
        WorkerLoad("d1", kv_usage=0.10, num_requests=9),
        WorkerLoad("d2", kv_usage=0.10, num_requests=3, routed=1),
    ]
    assert choose_decode(loads).worker_id == "d2"  # 0.10 ties; 3 + 1 < 9
    loads[2].routed = 7
    assert choose_decode(loads).worker_id == "d1"  # 9 < 3 + 7


def test_a_pool_resize_moves_only_the_prefixes_of_the_worker_that_came_or_went():
    four = [f"w{i}" for i in range(4)]
    before = {k: affine_worker(four, k) for k in KEYS}
    assert set(before.values()) == set(four)  # every worker owns some prefixes
    five = {k: affine_worker([*four, "w4"], k) for k in KEYS}
    moved = [k for k in KEYS if five[k] != before[k]]
    assert all(five[k] == "w4" for k in moved)  # only to the new worker
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # about 1/5 of them
    three = {k: affine_worker(four[1:], k) for k in KEYS}
    assert all(three[k] == before[k] for k in KEYS if before[k] != "w0")  # only w0's move


def _router(workers: list[tuple[str, str]]) -> Router:
    return Router({"router": {"imbalance_threshold": 4}}, [(wid, role, object()) for wid, role in workers])


def test_two_router_replicas_make_the_same_prefix_choice():
    members = [
        ("prefill-b", "prefill"),
        ("prefill-a", "prefill"),
        ("prefill-c", "prefill"),
        ("decode-a", "decode"),
    ]
    first, second = _router(members), _router(list(reversed(members)))

    async def choices(router: Router) -> list[str]:
        out = []
        for key in KEYS[:100]:
            wid, _ = await router.route("prefill", key)
            router.workers[wid].load.routed = 0  # as after a load report: only affinity counts
            out.append(wid)
        return out

    a, b = asyncio.run(choices(first)), asyncio.run(choices(second))
    assert a == b and len(set(a)) == 3
    wid, _ = asyncio.run(second.route("decode"))
    assert wid == "decode-a"


def test_route_excludes_tried_workers_and_says_when_none_is_left():
    router = _router([("mixed-0", "mixed"), ("mixed-1", "mixed")])
    wid, _ = asyncio.run(router.route("mixed", KEYS[0], exclude=["mixed-0"]))
    assert wid == "mixed-1"
    assert asyncio.run(router.route("mixed", KEYS[0], exclude=["mixed-0", "mixed-1"])) is None  # none left
    router.workers["mixed-1"].accepting = False  # draining: chosen no more
    assert asyncio.run(router.route("mixed", KEYS[0]))[0] == "mixed-0"


def test_a_worker_that_misses_health_probes_gets_no_requests_until_it_answers(monkeypatch):
    """A probe that times out is not ignored: after MAX_MISSED_PROBES in a row the worker
    is out of the pool (alive, maybe stuck); its next answer brings it back."""
    from kvray.actors.messages import WorkerStats
    from kvray.router import router as router_module
    from kvray.router.router import MAX_MISSED_PROBES

    monkeypatch.setattr(router_module, "STATS_TIMEOUT_S", 0.05)

    class Handle:
        stuck = True

        class stats:  # noqa: N801 (shaped like an actor method)
            @staticmethod
            def remote():
                async def answer():
                    if Handle.stuck:
                        await asyncio.sleep(1.0)
                    return WorkerStats("decode-0", "decode", 0, 0, 0.0, 0, 0, 0, 0.0)

                return answer()

    router = Router({}, [("decode-0", "decode", Handle)])

    async def run():
        for _ in range(MAX_MISSED_PROBES - 1):
            await router.refresh()
        assert (await router.route("decode"))[0] == "decode-0"  # a slow answer or two: still in
        await router.refresh()
        assert await router.route("decode") is None
        Handle.stuck = False
        await router.refresh()
        assert (await router.route("decode"))[0] == "decode-0"

    asyncio.run(run())
