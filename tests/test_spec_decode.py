"""Speculative decoding's parts on hand-made inputs: the n-gram proposer, the config,
the rejection sampler (greedy picks by hand; sampled outputs against the target
distribution by chi-squared), and the scheduler's draft steps and rollbacks.

Chi-squared bounds: with 3 degrees of freedom P(X > 16.27) = 0.001 under the null (2:
13.82), and
the draws are seeded, so a correct sampler fails with probability ~0.1 % per seed; a
sampler that keeps a draft with p(d) / q(d) replaced by anything else shifts the first
token's mass by several hundred counts out of 6000, far past the bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.rejection_sampler import verify
from kvray.engine.request import Request
from kvray.engine.sampler import Sampler, SampleRow
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.scheduler import Scheduler
from kvray.engine.spec_decode import NgramProposer, SpecDecodeStats, SpeculativeConfig
from kvray.errors import InvalidArgumentError

CHI2_3DF_999 = 16.27
CHI2_2DF_999 = 13.82

# ---- the n-gram proposer ----------------------------------------------------------------


def ngram(k_min: int = 2, k_max: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", 4, prompt_lookup_max=k_max, prompt_lookup_min=k_min))


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 6, 7]
    # suffix [6, 7]: earlier at 1 (then 8, 9, 1) and at 6 (then 3, 6, 7): the latest wins;
    # no 3- or 4-token suffix ([3, 6, 7], [8, 3, 6, 7]) occurs before
    assert ngram().propose(tokens, 4) == [3, 6, 7]
    assert ngram().propose(tokens, 2) == [3, 6]
    # a longer match beats a later shorter one: [1, 2, 3] at 0 over [2, 3] at 5
    assert ngram().propose([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 2) == [4, 9]


def test_ngram_drafts_two_tokens_per_matched_token():
    """A short match proposes a short draft: 2 tokens per token of the matched suffix."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3]
    assert ngram(k_max=4).propose(tokens, 16) == [4, 5, 6, 7, 8, 9]  # [1, 2, 3] matched: 6
    assert ngram(k_max=4).propose(tokens, 5) == [4, 5, 6, 7, 8]  # k still bounds it
    assert ngram(k_min=1).propose([5, 1, 2, 3, 4, 5], 8) == [1, 2]  # a unigram: 2
    assert ngram(k_max=2).propose(tokens, 16) == [4, 5, 6, 7]  # at most 2 matched: 4


def test_ngram_proposes_nothing_without_a_match_or_room():
    assert ngram().propose([1, 2, 3, 4, 5], 4) == []  # no repeated suffix
    assert ngram().propose([1, 2, 1, 2], 0) == []  # no room
    assert ngram(k_min=3).propose([1, 2, 9, 1, 2], 4) == []  # [1, 2] is shorter than min
    assert ngram(k_min=1, k_max=1).propose([4, 8, 4], 3) == [8, 4]  # unigram lookup
    # the match may end where the suffix starts: [7, 7] at 0 is followed by the last 7
    assert ngram().propose([7, 7, 7], 4) == [7]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "speculative_config.lookup"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ("ngram", "speculative_config"),
    ],
)
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(InvalidArgumentError) as e:
        SpeculativeConfig.parse(value)
    assert e.value.field == field


def test_spec_stats_count_drafts_tokens_and_acceptance_per_position():
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(3, 3)
    stats.record(0, 0)  # a request without drafts is not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 7, 5)
    assert stats.accepted_per_pos == [2, 2, 1, 0]
    assert stats.acceptance_rate == pytest.approx(5 / 7)


# ---- the rejection sampler ---------------------------------------------------------------

P0 = [0.5, 0.3, 0.15, 0.05]  # the target after the known tokens
P1 = [0.1, 0.2, 0.3, 0.4]  # the target after draft 1
P2 = [0.25, 0.25, 0.25, 0.25]


def rows(n_positions: int, rid: str = "r", **params) -> list[SampleRow]:
    sp = SamplingParams(**params)
    return [SampleRow(rid, sp, 0, j, [], []) for j in range(n_positions)]


def test_greedy_keeps_drafts_up_to_the_first_miss_then_the_argmax():
    logits = torch.tensor([[0, 5.0, 0, 0], [0, 0, 5.0, 0], [5.0, 0, 0, 0], [0, 0, 0, 5.0]])
    greedy = rows(4, temperature=0.0)
    # argmaxes 1, 2, 0, 3: drafts [1, 2, 0] all kept, then the bonus 3
    assert verify(Sampler(4), logits, greedy, [[1, 2, 0]]).token_ids == [[1, 2, 0, 3]]
    # drafts [1, 3, 0]: the second misses, the argmax 2 replaces it, nothing after
    assert verify(Sampler(4), logits, greedy, [[1, 3, 0]]).token_ids == [[1, 2]]
    assert verify(Sampler(4), logits[:1], greedy[:1], [[]]).token_ids == [[1]]


def test_requests_of_a_batch_keep_their_own_rows_and_logprobs():
    logits = torch.tensor([[0, 5.0, 0, 0], [0, 0, 5.0, 0], [5.0, 0, 0, 0], [0, 0, 0, 5.0]])
    batch = (
        rows(2, "a", temperature=0.0, logprobs=1)
        + rows(1, "b", temperature=0.0)
        + rows(1, "c", temperature=0.0)
    )
    out = verify(Sampler(4), logits, batch, [[1], [], [2]])
    assert out.token_ids == [[1, 2], [0], [3]]  # c's draft 2 misses its argmax 3
    lp = torch.tensor([0, 5.0, 0, 0]).log_softmax(-1)[1].item()
    assert [e[0] for e in out.logprobs[0]] == pytest.approx([lp, lp])
    assert out.logprobs[1] == [None] and out.logprobs[2] == [None]


def _chi2(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def _sampled_batch(n: int, draft_probs=None, drafts=None, **params):
    logits = torch.tensor([P0, P1, P2]).log().repeat(n, 1)
    params = {"temperature": 1.0, **params}
    batch = [row for i in range(n) for row in rows(3, f"r{i}", **params)]
    drafts = drafts or [[1, 3]] * n
    torch.manual_seed(0)
    return verify(Sampler(4), logits, batch, drafts, draft_probs).token_ids


def test_rejection_sampling_keeps_the_target_distribution_with_ngram_drafts():
    """Drafts [1, 3] are always proposed (q one-hot): the first token must still follow
    P0, and the second, when draft 1 was kept, P1 — not the drafts."""
    out = _sampled_batch(6000)
    first = [t[0] for t in out]
    assert _chi2([first.count(v) for v in range(4)], P0) < CHI2_3DF_999
    second = [t[1] for t in out if t[0] == 1]
    assert _chi2([second.count(v) for v in range(4)], P1) < CHI2_3DF_999
    assert all(len(t) == 1 for t in out if t[0] != 1)  # a rejection ends the walk


def test_rejection_sampling_keeps_the_target_distribution_with_a_draft_model():
    """Drafts drawn from a proposer distribution q far from the target."""
    n = 6000
    q = torch.tensor([[0.05, 0.05, 0.1, 0.8], [0.7, 0.1, 0.1, 0.1]])
    g = torch.Generator().manual_seed(1)
    drafts = [
        [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
        for _ in range(n)
    ]
    out = _sampled_batch(n, [q] * n, drafts)
    first = [t[0] for t in out]
    assert _chi2([first.count(v) for v in range(4)], P0) < CHI2_3DF_999


def _tempered_top3(p: list[float], temperature: float) -> list[float]:
    """p at a temperature (p ** (1 / T), renormalised), its smallest entry cut (top_k=3)."""
    w = [x ** (1 / temperature) for x in p]
    w[w.index(min(w))] = 0.0
    return [x / sum(w) for x in w]


def test_rejection_sampling_keeps_the_processed_distribution_at_a_temperature_and_top_k():
    """At temperature 0.5 with top_k=3 the tokens follow the processed target: each
    position's distribution squared and renormalised, its least likely token never drawn
    (the first position's 3, the second's 0)."""
    out = _sampled_batch(6000, temperature=0.5, top_k=3)
    first = [t[0] for t in out]
    expect = _tempered_top3(P0, 0.5)
    assert first.count(3) == 0
    assert _chi2([first.count(v) for v in range(3)], expect[:3]) < CHI2_2DF_999
    second = [t[1] for t in out if t[0] == 1]  # draft 1 kept: the token after it follows P1 processed
    expect = _tempered_top3(P1, 0.5)
    assert second.count(0) == 0
    assert _chi2([second.count(v) for v in range(1, 4)], expect[1:]) < CHI2_2DF_999


def test_sampled_draft_acceptance_rate_is_the_target_probability():
    """An n-gram draft d is kept with probability p(d): draft 0 (p = 0.5) about half the time."""
    out = _sampled_batch(4000, drafts=[[0, 3]] * 4000)
    kept = sum(len(t) > 1 for t in out) / len(out)
    assert math.isclose(kept, 0.5, abs_tol=0.04)


# ---- the scheduler: draft steps, rollbacks, block accounting -----------------------------

BS = 4


def make_request(rid: str, prompt_len: int, first: int = 1, **params) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first, first + prompt_len)),
        sampling_params=SamplingParams(**{"max_tokens": 100, "temperature": 0.0, **params}),
        eos_token_ids=frozenset({0}),
        block_size=BS,
    )


def make_scheduler(num_blocks: int = 16, budget: int = 64) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BS), max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256
    )


def prefill(sched: Scheduler, req: Request) -> None:
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {req.request_id: [50]})


def decoding_with(drafts: list[int]):
    """(scheduler, request, step): a 6-token prompt prefilled (6 computed, 7 known, 2
    blocks, token 50 sampled), then a step scheduled with these drafts."""
    sched = make_scheduler()
    req = make_request("a", 6)
    prefill(sched, req)
    req.spec_token_ids = list(drafts)
    return sched, req, sched.schedule()


def test_a_decode_with_drafts_is_scheduled_as_1_plus_k_tokens_and_samples():
    sched, req, out = decoding_with([60, 61, 62])
    assert out.num_scheduled_tokens == [4] and out.draft_token_ids == [[60, 61, 62]]
    assert out.samples(0)
    assert len(sched.kv.block_ids("a")) == 3  # positions 0-9 need 3 blocks of 4


def test_rejected_drafts_roll_back_and_free_their_blocks():
    sched, req, out = decoding_with([60, 61, 62])
    free_before = sched.kv.pool.num_available
    # kept 60, then the target's own 70: 61 and 62 rejected
    sched.update_from_output(out, {"a": [60, 70]})
    assert req.output_token_ids == [50, 60, 70]
    assert req.num_computed_tokens == 8  # 6 + the token 50 + the draft 60
    assert req.num_tokens == 9
    # positions 8 and 9 held only rejected drafts; block 2 (positions 8-11) goes back
    assert len(sched.kv.block_ids("a")) == 2
    assert sched.kv.pool.num_available == free_before + 1
    assert req.spec_token_ids == []
    sched.kv.pool.check_integrity()


def test_all_drafts_kept_and_the_bonus_token():
    sched, req, out = decoding_with([60, 61])
    sched.update_from_output(out, {"a": [60, 61, 71]})
    assert req.output_token_ids == [50, 60, 61, 71]
    assert (req.num_computed_tokens, req.num_tokens) == (9, 10)
    assert len(sched.kv.block_ids("a")) == 3


def test_drafts_are_cut_to_the_token_budget():
    sched = make_scheduler(budget=10)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [50], "b": [50]})
    a.spec_token_ids = [60, 61, 62, 63, 64, 65, 66, 67]
    b.spec_token_ids = [60, 61]
    out = sched.schedule()
    # a takes 1 + 8 = 9 of 10; b's decode gets the last one and no drafts
    assert out.num_scheduled_tokens == [9, 1] and out.draft_token_ids == [
        [60, 61, 62, 63, 64, 65, 66, 67],
        [],
    ]


def test_a_stop_token_among_kept_drafts_ends_the_request_there():
    sched, req, out = decoding_with([60, 0, 62])
    sched.update_from_output(out, {"a": [60, 0, 62, 73]})
    assert req.output_token_ids == [50, 60, 0] and req.finished
    assert sched.kv.pool.stats().used_blocks == 0


def test_only_blocks_full_of_known_tokens_enter_the_prefix_cache():
    sched = make_scheduler()
    req = make_request("a", 7)
    prefill(sched, req)  # 7 computed; known: 1..7, 50
    req.spec_token_ids = [60, 61, 62, 63]  # positions 8-11: block 2
    out = sched.schedule()
    pool, held = sched.kv.pool, sched.kv.block_ids("a")
    assert len(held) == 3
    assert [pool.block_hash[b] is not None for b in held] == [True, True, False]
    sched.update_from_output(out, {"a": [60, 99]})
    # 9 computed (position 8 holds the kept 60), 10 known: block 2 stays, unhashed
    assert (req.num_computed_tokens, req.num_tokens) == (9, 10)
    assert sched.kv.block_ids("a") == held and pool.block_hash[held[2]] is None
    # the next step computes 99 at position 9; block 2 is full of known tokens only once
    # positions 10 and 11 are known and computed
    for token in (100, 101):
        out = sched.schedule()
        sched.update_from_output(out, {"a": [token]})
    assert pool.block_hash[held[2]] is None  # position 11 (101) is known, not computed
    out = sched.schedule()
    assert pool.block_hash[held[2]] == req.block_hashes[2]  # indexed as its last position runs
    pool.check_integrity()


def _two_prefilled(num_blocks: int) -> tuple[Scheduler, Request, Request]:
    """a and b: 8-token prompts (no block in common) computed, 2 blocks each, and one
    token sampled each."""
    sched = make_scheduler(num_blocks=num_blocks)
    a, b = make_request("a", 8), make_request("b", 8, first=101)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [50], "b": [50]})
    return sched, a, b


def test_drafts_are_dropped_rather_than_preempting_anyone():
    sched, a, b = _two_prefilled(num_blocks=6)
    a.spec_token_ids = [60, 61, 62, 63, 64, 65, 66, 67]
    b.spec_token_ids = [60]
    out = sched.schedule()
    # a's 1 + 8 tokens need 3 more blocks, 2 are free: a runs its token alone (1 block);
    # b's token and draft then fit in the last one
    assert out.preempted == [] and out.num_scheduled_tokens == [1, 2]
    assert out.draft_token_ids == [[], [60]]
    sched.update_from_output(out, {"a": [70], "b": [71]})  # b's draft rejected
    assert (a.num_computed_tokens, b.num_computed_tokens) == (9, 9)
    assert [len(sched.kv.block_ids(r)) for r in "ab"] == [3, 3]  # position 9 of b: block 2
    sched.kv.pool.check_integrity()


def test_a_request_preempted_with_drafts_loses_them_and_its_blocks():
    sched, a, b = _two_prefilled(num_blocks=5)
    a.spec_token_ids = [60, 61, 62, 63, 64, 65, 66, 67]
    b.spec_token_ids = [60]
    out = sched.schedule()
    # a drops its drafts and takes the last free block; b's own token no longer fits:
    # b (ranked last) is preempted, drafts and all
    assert out.preempted == [b] and out.requests == [a] and out.num_scheduled_tokens == [1]
    assert b.num_computed_tokens == 0 and b.spec_token_ids == [] and sched.kv.block_ids("b") == []
    sched.update_from_output(out, {"a": [70]})
    sched.abort(["a"])
    out = sched.schedule()  # b comes back: its prompt's 2 full blocks are prefix hits
    assert [r.request_id for r in out.requests] == ["b"] and b.num_computed_tokens == 8
    assert out.num_scheduled_tokens == [1]  # only its sampled token is computed again
    sched.update_from_output(out, {"b": [80]})
    assert b.output_token_ids == [50, 80]
    sched.abort(["b"])
    assert sched.kv.pool.stats().used_blocks == 0
    sched.kv.pool.check_integrity()
