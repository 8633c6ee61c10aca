"""Speculative decoding: propose a few tokens cheaply, verify them in one target forward.

A decoding request normally runs one token a step. With speculation it runs its last
token plus k proposed ("draft") tokens, like a short prompt chunk; the target model's
logits at all k + 1 positions decide, left to right, how many drafts to keep (see
`rejection_sampler.py`), and always add one token of its own. A step that is bound by
reading the weights costs about the same for 1 or 1 + k rows, so every accepted draft
is a token for free. Rejected drafts' KV slots lie past the request's computed tokens:
the scheduler rolls `num_computed_tokens` back over them and frees blocks that hold
nothing else; they were never hashed, so the prefix cache never sees them.

Proposers (vLLM's `speculative_config` methods):
* `ngram` — prompt lookup: find the latest earlier occurrence of the sequence's last
  n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) and propose what
  followed it, up to 2n tokens (and k). Free to run, and strong on input-grounded work
  (copying, editing, extraction), where the output repeats spans of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import numpy as np

from kvray.errors import InvalidArgumentError, check_range

Method = Literal["ngram", "draft_model"]
METHODS: tuple[str, ...] = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: Method
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: longest suffix to match
    prompt_lookup_min: int = 2  # ngram: shortest suffix to match
    model: str | None = None  # draft_model: the proposer (same tokenizer as the target)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgumentError("speculative_config.method", self.method, f"one of {METHODS}")
        check_range("speculative_config.num_speculative_tokens", self.num_speculative_tokens, low=1, high=16)
        if self.method == "ngram":
            check_range("speculative_config.prompt_lookup_min", self.prompt_lookup_min, low=1)
            check_range(
                "speculative_config.prompt_lookup_max", self.prompt_lookup_max, low=self.prompt_lookup_min
            )
        elif not self.model:
            raise InvalidArgumentError(
                "speculative_config.model", self.model, "a model for method 'draft_model'"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """The engine's form of the user's dict (vLLM's keys); unknown keys are errors."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidArgumentError("speculative_config", value, "a dict such as {'method': 'ngram', ...}")
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise InvalidArgumentError(f"speculative_config.{key}", value[key], f"one of {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise InvalidArgumentError(f"speculative_config.{key}", None, "a value (required)")
        return cls(**value)


@dataclass
class SpecDecodeStats:
    """vLLM's `spec_decode` counters: drafts verified, tokens proposed and accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos += [0] * (num_proposed - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


DRAFTS_PER_MATCHED = 2


class NgramProposer:
    """Prompt lookup over a sequence's own tokens (prompt and output so far)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix
        (from `max_n` down to `min_n` tokens) that occurs before; [] when none does.

        A draft is at most DRAFTS_PER_MATCHED tokens per matched token: a short match
        predicts a short run (each verified row costs compute), a long one a long run.
        On the grounded benchmark's greedy outputs (BENCHMARKS.md) this keeps k=8's
        tokens per step within 3 % of a fixed-length draft's with a quarter fewer rows."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows starting at 0 .. total-n-1: each is followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + min(k, DRAFTS_PER_MATCHED * n)].tolist()
        return []
