"""Router policy with hand-checkable loads: prefix affinity, imbalance override, decode choice."""

from __future__ import annotations

from kvray.router.policy import WorkerLoad, choose_decode, choose_prefill, prefix_key


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
    loads = [WorkerLoad("p0", in_flight=0), WorkerLoad("p1", in_flight=0)]
    key = next(
        k
        for k in (prefix_key([i] * 16, 16, 1) for i in range(100))
        if choose_prefill(loads, k, 4).worker_id == "p1"
    )
    loads[1].in_flight = 4  # gap of 4: not beyond the threshold
    assert choose_prefill(loads, key, 4).worker_id == "p1"
    loads[1].in_flight = 5  # gap of 5 > 4: least loaded wins
    assert choose_prefill(loads, key, 4).worker_id == "p0"


def test_no_full_block_goes_to_the_least_loaded():
    loads = [WorkerLoad("p0", in_flight=3), WorkerLoad("p1", in_flight=1), WorkerLoad("p2", in_flight=2)]
    assert choose_prefill(loads, None, 4).worker_id == "p1"


def test_decode_choice_is_least_kv_usage_then_fewest_requests():
    loads = [
        WorkerLoad("d0", kv_usage=0.50, num_running=1),
        WorkerLoad("d1", kv_usage=0.10, num_running=9),
        WorkerLoad("d2", kv_usage=0.10, num_running=3, in_flight=1),
    ]
    assert choose_decode(loads).worker_id == "d2"  # 0.10 ties; 3 + 1 < 9
    loads[2].in_flight = 7
    assert choose_decode(loads).worker_id == "d1"  # 9 < 3 + 7
