"""The engine's half of a KV hand-off (engine/kv_handoff.py): the scheduler asks the
connector at each finish whether a request's blocks are held for a pull. Block size 4 and
a 16-block pool, so every block id can be traced by hand."""

from __future__ import annotations

import time

from test_scheduler import BS, TOKEN, make_request

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.kv_handoff import KVHandoff, LeasePolicy
from kvray.engine.scheduler import Scheduler


def test_connector_decides_which_finished_requests_keep_their_blocks():
    """The scheduler asks its connector at each finish; a prefill held for a pull keeps
    its blocks (now the connector's, under a pin), an aborted one and a plain one free
    theirs. 6-token prompts of block size 4: two blocks each; 16 blocks in all."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    handoff = KVHandoff(kv, BS)
    sched = Scheduler(kv, 8, 64, 1024, connector=handoff)
    for rid, first in (("held", 1), ("plain", 20), ("aborted", 40)):
        sched.add_request(make_request(rid, 6, first_token=first, max_tokens=1))
    handoff.expect("held")
    handoff.expect("aborted")
    out = sched.schedule()  # all three prefill in one step: 18 tokens, 6 blocks
    assert kv.stats().used_blocks == 6
    held_blocks = kv.block_ids("held")
    sched.abort(["aborted"])
    assert kv.stats().used_blocks == 4
    sched.update_from_output(out, {r.request_id: [TOKEN] for r in out.requests if r.request_id != "aborted"})
    # both finished at max_tokens=1; only the held one's two blocks stay used
    assert kv.stats().used_blocks == 2
    assert handoff.pins.begin_read("held") == held_blocks
    handoff.pins.end_read("held")
    assert handoff.num_pinned == 1 and not handoff.leases
    ticket = handoff.ticket("prefill-0", "held", layout=None)
    assert ticket.block_ids == tuple(held_blocks) and ticket.num_tokens == 6
    assert len(ticket.block_hashes) == 1  # one full block of the 6 prompt tokens
    assert handoff.release("held") and kv.stats().used_blocks == 0


def test_a_release_that_overtakes_its_read_frees_the_blocks_when_the_read_ends():
    """A torch_dist pull's receiver confirms (release) before the sender's last send has
    returned (the read still open): the release is not lost to the lease, the blocks go at
    the engine's first `expire` after the read ends, long before the deadline."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    handoff = KVHandoff(kv, BS)
    sched = Scheduler(kv, 8, 64, 1024, connector=handoff)
    sched.add_request(make_request("held", 6, first_token=1, max_tokens=1))
    handoff.expect("held")
    out = sched.schedule()
    sched.update_from_output(out, {"held": [TOKEN]})
    blocks = handoff.pins.begin_read("held")  # the pull's sender starts
    assert len(blocks) == 2 and kv.stats().used_blocks == 2
    assert not handoff.release("held")  # the receiver's confirmation, while the read is open
    assert handoff.pins.begin_read("held") is None  # let go: no new read
    handoff.expire(now=0.0)
    assert kv.stats().used_blocks == 2  # still being read
    handoff.pins.end_read("held")
    handoff.expire(now=0.0)  # the deadline is 30 s away
    assert kv.stats().used_blocks == 0 and handoff.num_pinned == 0


def test_a_multi_shard_hold_keeps_a_pin_past_its_lease_until_released_or_its_hold_ends():
    """A sharded pull's driver holds the pin while its shards send pieces: the pin outlives
    its lease (here 1 s) until the decode side releases it, or for the policy's hold (two
    pull timeouts: 10 s) should that side vanish. Times are time.time() seconds."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    handoff = KVHandoff(kv, BS, LeasePolicy(lease_s=1.0, pull_timeout_s=5.0))
    sched = Scheduler(kv, 8, 64, 1024, connector=handoff)
    for rid, first in (("released", 1), ("vanished", 20)):  # (prompts sharing no block)
        sched.add_request(make_request(rid, 6, first_token=first, max_tokens=1))
        handoff.expect(rid)
    out = sched.schedule()
    sched.update_from_output(out, {r.request_id: [TOKEN] for r in out.requests})
    assert kv.stats().used_blocks == 4
    now = time.time()
    blocks = handoff.pins.hold("released")
    assert blocks == kv_blocks_of(handoff, "released") and len(blocks) == 2
    assert handoff.pins.hold("released") is None  # held already
    assert handoff.pins.hold("vanished") is not None
    handoff.expire(now=now + 5.0)  # both leases over (1 s), both held (10 s)
    assert kv.stats().used_blocks == 4
    handoff.pins.unhold("released")  # the decode side's release: its hold ends, then the pin
    assert handoff.release("released") and kv.stats().used_blocks == 2
    handoff.expire(now=now + 9.0)
    assert kv.stats().used_blocks == 2  # the other's hold lasts until now + 10 s
    handoff.expire(now=now + 10.5)
    assert kv.stats().used_blocks == 0 and handoff.num_pinned == 0


def kv_blocks_of(handoff: KVHandoff, request_id: str) -> list[int]:
    return list(handoff.pins.pins[request_id].blocks)
