"""Incremental detokenization and stop strings.

Decoding only a short window of recent tokens per step keeps the cost per token
constant: `prefix_offset..read_offset` are the tokens of the last emitted piece, used as
left context so byte-level BPE pieces and leading spaces decode as in a full decode. A window
that ends inside a multi-byte character (U+FFFD at the end) is held back until the next
token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self):
        self.special_ids = special_token_ids(self.tokenizer) if self.skip_special_tokens else set()

    def _decode(self, ids: list[int]) -> str:
        ids = [t for t in ids if t not in self.special_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token; returns the stop string it completed, if any."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return self._check_stop(len(full) - len(prefix))
        return None

    def visible_text(self) -> str:
        """The text a stream may show before the request ends: the tail that could still
        become the start of a stop string is held back, so streamed text never shows
        characters that the final (cut) text does not have."""
        hold = max((len(s) for s in self.stop_strings), default=1) - 1
        return self.text[: max(len(self.text) - hold, 0)] if hold else self.text

    def _check_stop(self, new_chars: int) -> str | None:
        """Cut the text at the earliest stop string that the new characters completed."""
        found = None  # (index, stop)
        for stop in self.stop_strings:
            # the stop string may straddle the new text and the old tail
            start = max(len(self.text) - new_chars - len(stop) + 1, 0)
            idx = self.text.find(stop, start)
            if idx != -1 and (found is None or idx < found[0]):
                found = (idx, stop)
        if found is None:
            return None
        idx, stop = found
        self.text = self.text[: idx + len(stop) if self.include_stop_str_in_output else idx]
        return stop


def special_token_ids(tokenizer) -> set[int]:
    """Every special token, the added ones flagged `special` included (what HF's
    `decode(skip_special_tokens=True)` drops)."""
    if tokenizer is None:
        return set()
    ids = set(tokenizer.all_special_ids)
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    return ids
