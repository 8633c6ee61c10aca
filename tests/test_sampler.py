"""Sampler on hand-made logits: greedy, seeds, top-k / top-p / min-p, penalties, logprobs.

The reference distribution used throughout is P = [0.5, 0.3, 0.15, 0.05], fed as logits
log(P) so that softmax(logits) == P at temperature 1. Supports are worked out by hand
from the rules in the sampler's docstrings; draws that must avoid a token are repeated
over a large batch so that a missing filter would show (e.g. token 2 has p=0.15: absent
from 2000 unfiltered draws with probability 0.85**2000 ~ 1e-141).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvray.engine.request import Request
from kvray.engine.sampler import Sampler, _filter_min_p, _filter_top_k_top_p
from kvray.engine.sampling_params import SamplingParams

P = [0.5, 0.3, 0.15, 0.05]
LOG_P = [math.log(p) for p in P]


def make_request(
    rid: str = "r", prompt: list[int] | None = None, output: list[int] = (), sample_index: int = 0, **params
) -> Request:
    req = Request(
        request_id=rid,
        prompt_token_ids=list(prompt or [1]),
        sampling_params=SamplingParams(**params),
        eos_token_ids=frozenset({0}),
        block_size=4,
        sample_index=sample_index,
    )
    for t in output:
        req.append_token(t)
    return req


def draw(logits_row: list[float], n: int, **params) -> set[int]:
    """The set of tokens seen in n independent draws (one batch of n identical rows)."""
    torch.manual_seed(0)
    req = make_request(**params)
    out = Sampler(len(logits_row))(torch.tensor([logits_row] * n), [req] * n)
    return set(out.token_ids)


# ---- greedy ---------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0], [-3.0, -2.0, -1.0, -1.5]])
    reqs = [make_request(f"r{i}", temperature=0.0) for i in range(3)]
    assert Sampler(4)(logits, reqs).token_ids == [1, 0, 2]


def test_greedy_row_stays_argmax_in_a_batch_with_random_rows():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]] * 3)
    logits[1] = torch.tensor([0.0, 0.0, 0.3, 0.0])
    reqs = [make_request("a", temperature=1.0), make_request("g", temperature=0.0), make_request("b")]
    for seed in range(20):
        torch.manual_seed(seed)
        assert Sampler(4)(logits, reqs).token_ids[1] == 2


def test_columns_beyond_vocab_size_are_never_sampled():
    # padded LM-head columns carry garbage; only the first vocab_size count
    logits = torch.tensor([[0.0, 1.0, 0.5, 100.0, 100.0]])
    assert Sampler(3)(logits, [make_request(temperature=0.0)]).token_ids == [1]
    torch.manual_seed(0)
    wide = torch.tensor([[0.0, 0.0, 0.0, 50.0]] * 500)
    assert set(Sampler(3)(wide, [make_request()] * 500).token_ids) == {0, 1, 2}


# ---- seeds ----------------------------------------------------------------------------


def seeded_tokens(position: int, batch: int, seed: int, global_seed: int, steps: int = 12) -> list[int]:
    """Tokens drawn for a seeded request at `position` of a batch of uniform rows."""
    torch.manual_seed(global_seed)
    sampler = Sampler(50)
    target = make_request("target", seed=seed)
    others = [make_request(f"o{i}", seed=1000 + i if i % 2 else None) for i in range(batch - 1)]
    reqs = others[:position] + [target] + others[position:]
    tokens = []
    for _ in range(steps):
        out = sampler(torch.zeros(batch, 50), reqs)
        tokens.append(out.token_ids[position])
    return tokens


def test_same_seed_gives_same_tokens_whatever_else_is_in_the_batch():
    alone = seeded_tokens(position=0, batch=1, seed=123, global_seed=0)
    crowded = seeded_tokens(position=2, batch=5, seed=123, global_seed=7)
    assert alone == crowded
    assert len(set(alone)) > 3  # it really is random over 50 uniform tokens
    assert seeded_tokens(position=0, batch=1, seed=124, global_seed=0) != alone


def test_sample_index_offsets_the_seed():
    torch.manual_seed(0)
    s = Sampler(50)
    a = make_request("a", seed=5, sample_index=1)
    b = make_request("b", seed=6, sample_index=0)
    c = make_request("c", seed=5, sample_index=0)
    rows = [s(torch.zeros(3, 50), [a, b, c]).token_ids for _ in range(10)]
    assert [r[0] for r in rows] == [r[1] for r in rows]  # seed 5 + 1 == seed 6 + 0
    assert [r[0] for r in rows] != [r[2] for r in rows]


def test_forget_restarts_a_seeded_stream():
    s = Sampler(50)
    req = make_request("a", seed=9)
    first = [s(torch.zeros(1, 50), [req]).token_ids[0] for _ in range(8)]
    s.forget("a")
    again = [s(torch.zeros(1, 50), [req]).token_ids[0] for _ in range(8)]
    assert first == again


# ---- top-k / top-p / min-p filters, exact supports ------------------------------------


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0]).flatten().tolist())


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.4, {0}),  # 0.5 already reaches 0.4
        (0.5, {0}),  # 0.5 reaches 0.5 exactly
        (0.6, {0, 1}),  # 0.5 < 0.6 <= 0.8
        (0.7, {0, 1}),
        (0.8, {0, 1}),  # 0.8 reaches 0.8 (float32 boundary, holds on CPU)
        (0.81, {0, 1, 2}),  # 0.8 < 0.81 <= 0.95
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, expected):
    probs = torch.tensor([P])
    assert support(_filter_top_k_top_p(probs, [-1], [top_p])) == expected


def test_top_p_support_does_not_depend_on_token_order():
    probs = torch.tensor([[0.05, 0.3, 0.15, 0.5]])  # P reversed: token 3 is the likeliest
    assert support(_filter_top_k_top_p(probs, [-1], [0.7])) == {3, 1}


@pytest.mark.parametrize("top_k, expected", [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (10, {0, 1, 2, 3})])
def test_top_k_keeps_k_most_likely(top_k, expected):
    assert support(_filter_top_k_top_p(torch.tensor([P]), [top_k], [1.0])) == expected


def test_top_p_is_measured_after_top_k():
    # top_k=2 leaves 0.5 and 0.3 (mass 0.8): renormalised 0.625, 0.375
    probs = torch.tensor([P])
    assert support(_filter_top_k_top_p(probs, [2], [0.6])) == {0}  # 0.625 reaches 0.6
    assert support(_filter_top_k_top_p(probs, [2], [0.7])) == {0, 1}
    assert support(_filter_top_k_top_p(probs, [-1], [0.6])) == {0, 1}  # without top-k


def test_filters_apply_per_row():
    probs = torch.tensor([P, P, P])
    kept = _filter_top_k_top_p(probs, [1, -1, -1], [1.0, 0.7, 1.0])
    assert [set(torch.nonzero(r).flatten().tolist()) for r in kept] == [{0}, {0, 1}, {0, 1, 2, 3}]


@pytest.mark.parametrize(
    "min_p, expected",
    [(0.0, {0, 1, 2, 3}), (0.1, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.61, {0}), (1.0, {0})],
)
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, expected):
    # threshold = min_p * 0.5: 0.1 -> 0.05 (keeps 0.05), 0.2 -> 0.1, 0.5 -> 0.25, 0.61 -> 0.305
    assert support(_filter_min_p(torch.tensor([P]), [min_p])) == expected


# ---- filters seen through sampling ----------------------------------------------------


def test_unfiltered_sampling_reaches_every_token():
    assert draw(LOG_P, 2000) == {0, 1, 2, 3}


def test_sampling_frequencies_follow_the_distribution():
    torch.manual_seed(0)
    n = 8000
    out = Sampler(4)(torch.tensor([LOG_P] * n), [make_request()] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).double() / n
    assert torch.allclose(counts, torch.tensor(P, dtype=torch.double), atol=0.025), counts


def test_top_k_2_only_ever_yields_the_top_2_tokens():
    # the top 2 are tokens 1 and 3; token 4 (logit 2.8) would be drawn ~27% of the time
    assert draw([1.0, 3.0, 0.5, 2.9, 2.8, -1.0], 2000, top_k=2) == {1, 3}


@pytest.mark.parametrize("top_p, expected", [(0.4, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2})])
def test_top_p_draws_stay_in_the_nucleus(top_p, expected):
    assert draw(LOG_P, 2000, top_p=top_p) == expected


def test_min_p_draws_stay_above_the_threshold():
    assert draw(LOG_P, 2000, min_p=0.5) == {0, 1}


def test_temperature_is_applied_before_top_p():
    # at T=0.5, P**2 renormalised = [0.685, 0.247, 0.062, 0.007]: 0.685 reaches 0.68
    assert draw(LOG_P, 2000, temperature=0.5, top_p=0.68) == {0}
    assert draw(LOG_P, 2000, temperature=1.0, top_p=0.68) == {0, 1}


# ---- penalties ------------------------------------------------------------------------

LOGITS = [1.0, 2.0, -1.0, 4.0, 3.5]


def penalised(req: Request) -> list[float]:
    logits = torch.tensor([LOGITS])
    out = Sampler(5)._apply_penalties(logits, [req])
    assert logits.tolist() == [LOGITS]  # the input is not modified in place
    return out[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # seen = prompt {1, 2} + output {3}: 2.0 -> 1.0, -1.0 -> -2.0, 4.0 -> 2.0; 0 and 4 unchanged
    req = make_request(prompt=[1, 2], output=[3], repetition_penalty=2.0)
    assert penalised(req) == [1.0, 1.0, -2.0, 2.0, 3.5]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    # outputs 3, 3, 1: token 3 -> 4.0 - (0.25*2 + 0.5) = 3.0; token 1 -> 2.0 - 0.75 = 1.25;
    # token 2 is only in the prompt: unchanged
    req = make_request(prompt=[2], output=[3, 3, 1], presence_penalty=0.5, frequency_penalty=0.25)
    assert penalised(req) == [1.0, 1.25, -1.0, 3.0, 3.5]


def test_negative_presence_penalty_encourages_repeats():
    req = make_request(output=[2], presence_penalty=-1.5)
    assert penalised(req) == [1.0, 2.0, 0.5, 4.0, 3.5]


def test_repetition_then_presence_penalty_combine():
    # token 3: 4.0 / 2 = 2.0, then - 1.0 = 1.0
    req = make_request(prompt=[0], output=[3], repetition_penalty=2.0, presence_penalty=1.0)
    assert penalised(req) == [0.5, 2.0, -1.0, 1.0, 3.5]


def test_penalties_flip_the_greedy_choice_only_for_their_row():
    plain = make_request("plain", prompt=[3], output=[3], temperature=0.0)
    rep = make_request("rep", prompt=[3], output=[3], temperature=0.0, repetition_penalty=2.0)
    freq = make_request("freq", output=[3], temperature=0.0, frequency_penalty=1.0)
    out = Sampler(5)(torch.tensor([LOGITS] * 3), [plain, rep, freq])
    assert out.token_ids == [3, 4, 4]  # 4.0 -> 2.0 and 4.0 -> 3.0, both below 3.5


# ---- logprobs -------------------------------------------------------------------------

RAW = [2.0, 1.0, 0.0, 3.0]
LSE = math.log(sum(math.exp(x) for x in RAW))  # log(31.193) = 3.4402


def test_logprobs_of_greedy_token_rank_and_sorted_top_k():
    req = make_request(temperature=0.0, logprobs=3)
    ((lp, rank, top),) = Sampler(4)(torch.tensor([RAW]), [req]).logprobs
    assert lp == pytest.approx(3.0 - LSE, abs=1e-5)  # -0.4402
    assert rank == 1
    assert [t for t, _ in top] == [3, 0, 1]
    assert [v for _, v in top] == pytest.approx([3.0 - LSE, 2.0 - LSE, 1.0 - LSE], abs=1e-5)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_logprobs_are_of_the_raw_logits_even_when_penalties_change_the_choice():
    # repetition penalty 3 turns token 3's 3.0 into 1.0, so greedy picks token 0 (2.0);
    # its logprob and rank are still those of the raw distribution: 2.0 - LSE, rank 2
    req = make_request(output=[3], temperature=0.0, repetition_penalty=3.0, logprobs=1)
    out = Sampler(4)(torch.tensor([RAW]), [req])
    assert out.token_ids == [0]
    lp, rank, top = out.logprobs[0]
    assert lp == pytest.approx(2.0 - LSE, abs=1e-5)  # -1.4402
    assert rank == 2
    assert len(top) == 1 and top[0][0] == 3


def test_logprobs_and_rank_of_randomly_sampled_tokens():
    # rank = 1 + number of tokens with a higher raw logit: 3 -> 1, 0 -> 2, 1 -> 3, 2 -> 4
    torch.manual_seed(0)
    n = 400
    out = Sampler(4)(torch.tensor([RAW] * n), [make_request(logprobs=0)] * n)
    expected_rank = {3: 1, 0: 2, 1: 3, 2: 4}
    ranks = set()
    for token, (lp, rank, top) in zip(out.token_ids, out.logprobs, strict=True):
        assert rank == expected_rank[token]
        assert lp == pytest.approx(RAW[token] - LSE, abs=1e-5)
        assert top == []
        ranks.add(rank)
    assert ranks == {1, 2, 3, 4}  # token 2 has p = 1/31.2: seen in 400 draws


def test_logprobs_only_for_rows_that_ask_and_k_per_row():
    reqs = [
        make_request("none", temperature=0.0),
        make_request("two", temperature=0.0, logprobs=2),
        make_request("four", temperature=0.0, logprobs=4),
    ]
    out = Sampler(4)(torch.tensor([RAW] * 3), reqs)
    assert out.logprobs[0] is None
    assert [t for t, _ in out.logprobs[1][2]] == [3, 0]
    assert [t for t, _ in out.logprobs[2][2]] == [3, 0, 1, 2]
    assert Sampler(4)(torch.tensor([RAW]), reqs[:1]).logprobs == [None]
