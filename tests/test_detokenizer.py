"""IncrementalDetokenizer with SmolLM2's real byte-level BPE tokenizer (offline, ~1 s to load).

The reference is always `tokenizer.decode` of all the ids at once; stop-string positions
are found by decoding growing prefixes of the ids, independently of the detokenizer.
"""

from __future__ import annotations

from itertools import pairwise

import pytest

from kvray.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "héllo wörld 日本語 🙂",
    "  two leading spaces,\nnew lines\n\n\tand a tab",
    "emoji 🙂🙃 family 👨\u200d👩\u200d👧 flags 🇫🇷 math ∑∫√ ÅÄÖ",
    "中文，日本語のテキスト、한국어 텍스트。",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int]:
    """Add ids until a stop string fires; returns (stop, number of ids consumed)."""
    for i, t in enumerate(ids):
        stop = detok.add_token(t)
        if stop is not None:
            return stop, i + 1
    return None, len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    seen = []
    for t in ids:
        assert detok.add_token(t) is None
        seen.append(detok.text)
    assert detok.text == tok.decode(ids)
    assert detok.text == text  # this tokenizer round-trips these texts exactly
    assert detok.token_ids == ids
    # text only grows, and never shows a half-decoded character
    for before, after in pairwise(seen):
        assert after.startswith(before)
    assert all("\ufffd" not in s for s in seen)


def test_multibyte_character_is_held_back_until_complete(tok):
    # "日" is 3 UTF-8 bytes split across byte-level tokens in SmolLM2's vocabulary
    ids = tok.encode(" 日", add_special_tokens=False)
    assert len(ids) > 1, ids
    detok = IncrementalDetokenizer(tok)
    for t in ids[:-1]:
        detok.add_token(t)
        assert "日" not in detok.text and "\ufffd" not in detok.text
    detok.add_token(ids[-1])
    assert detok.text == " 日"


def test_special_tokens_are_skipped_unless_asked(tok):
    ids = tok.encode("Hi there", add_special_tokens=False)
    eos = tok.eos_token_id
    skip = IncrementalDetokenizer(tok)
    feed(skip, ids + [eos])
    assert skip.text == tok.decode(ids + [eos], skip_special_tokens=True) == "Hi there"

    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    feed(keep, ids + [eos])
    assert keep.text == tok.decode(ids + [eos]) == "Hi there" + tok.eos_token


def first_prefix_containing(tok, ids: list[int], s: str) -> int:
    return next(k for k in range(1, len(ids) + 1) if s in tok.decode(ids[:k]))


@pytest.mark.parametrize(
    "text, stop",
    [
        ("The answer is 42. STOP here and more text", "STOP"),
        ("The answer is 42. STOP here and more text", "wer is 4"),  # spans several tokens
        ("héllo wörld 日本語 🙂 and after", "日本"),  # multi-byte stop string
        ("one, two, three", " two"),
    ],
)
def test_stop_string_truncates_text_at_the_token_that_completes_it(tok, text, stop):
    ids = tok.encode(text, add_special_tokens=False)
    cut = text.index(stop)
    expected_consumed = first_prefix_containing(tok, ids, stop)

    detok = IncrementalDetokenizer(tok, stop_strings=[stop])
    fired, consumed = feed(detok, ids)
    assert fired == stop
    assert consumed == expected_consumed
    assert detok.text == text[:cut]

    keep = IncrementalDetokenizer(tok, stop_strings=[stop], include_stop_str_in_output=True)
    fired, consumed = feed(keep, ids)
    assert fired == stop
    assert consumed == expected_consumed
    assert keep.text == text[: cut + len(stop)]


def test_first_matching_stop_string_in_the_text_wins_the_cut(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop_strings=["delta", "beta"])
    fired, consumed = feed(detok, ids)
    assert fired == "beta"  # completed first, long before "delta"
    assert consumed == first_prefix_containing(tok, ids, "beta")
    assert detok.text == "alpha "


def test_absent_stop_string_never_fires(tok):
    text = "nothing to see here"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop_strings=["STOP", "xyz"])
    assert feed(detok, ids) == (None, len(ids))
    assert detok.text == text


def test_earliest_stop_string_wins_when_one_piece_completes_two(tok):
    """Both stop strings complete in the same decoded piece: the text is cut at the one
    that starts first, whatever the order of the list."""
    detok = IncrementalDetokenizer(tok, stop_strings=["ab", "xa"])
    detok.text = "zzx"  # as if "zzx" had been emitted already
    detok.token_ids = tok.encode("zzx", add_special_tokens=False)
    detok.prefix_offset = detok.read_offset = len(detok.token_ids)
    assert detok._check_stop(new_chars=0) is None
    detok.text += "abc"
    assert detok._check_stop(new_chars=3) == "xa"
    assert detok.text == "zz"


def test_visible_text_holds_back_a_possible_stop_string_start(tok):
    detok = IncrementalDetokenizer(tok, stop_strings=["END!"])
    detok.text = "hello EN"
    assert detok.visible_text() == "hello"  # "EN" (and one more char) may begin "END!"
    assert IncrementalDetokenizer(tok).visible_text() == ""
    plain = IncrementalDetokenizer(tok)
    plain.text = "abc"
    assert plain.visible_text() == "abc"  # no stop strings: nothing held back


def test_visible_text_shorter_than_the_hold_shows_nothing(tok):
    """Text shorter than the hold: a negative slice end would show "abc" of "abcd", which
    the stop string "abcdef" may still cut away entirely."""
    detok = IncrementalDetokenizer(tok, stop_strings=["abcdef"])
    detok.text = "abcd"
    assert detok.visible_text() == ""
    detok.text = "xyabcde"  # 7 chars, hold 5: only "xy" can never begin the stop string
    assert detok.visible_text() == "xy"
