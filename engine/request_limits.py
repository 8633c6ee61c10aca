"""What one request may ask of an engine, against its model: token ids within the
vocabulary, a prompt that fits the context, and bounds on the per-request work that every
step repeats (stop strings) or that a grammar costs to build.

The same `RequestLimits` is checked twice, by the same code: at the ingress, before the
request is admitted (router/ingest.py: a bad request is an HTTP 400 naming the field), and
at the engine's intake (offline callers, handle and actor callers). Nothing that passes
here can fail a step for a reason of the request's own making; what still fails inside a
step fails that request alone (engine/llm_engine.py).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass

from kvray.engine.sampling_params import SamplingParams
from kvray.errors import InvalidArgumentError

# defaults of the configurable bounds (EngineConfig fields of the same names)
MAX_STOP_STRINGS = 16  # OpenAI's API takes 4; vLLM sets no bound
MAX_STOP_STRING_LENGTH = 256  # characters of one stop string
MAX_GRAMMAR_BYTES = 64 << 10  # a JSON schema (as JSON text), regex, grammar or the choices together
MAX_GRAMMAR_DEPTH = 64  # nesting of a JSON schema's objects and arrays


CONFIGURABLE = ("max_stop_strings", "max_stop_string_length", "max_grammar_bytes", "max_grammar_depth")


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_length: int = MAX_STOP_STRING_LENGTH
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES
    max_grammar_depth: int = MAX_GRAMMAR_DEPTH

    @classmethod
    def of(cls, config, vocab_size: int, max_model_len: int) -> RequestLimits:
        """The model's limits with the configurable bounds of an EngineConfig."""
        return cls(vocab_size, max_model_len, **{name: getattr(config, name) for name in CONFIGURABLE})

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidArgumentError for the first thing outside the limits."""
        self.check_prompt(prompt_ids)
        self.check_params(params)

    def check_prompt(self, prompt_ids: list[int], field: str = "prompt") -> None:
        """At least one token, fewer than max_model_len, every id in the vocabulary."""
        if not prompt_ids:
            raise InvalidArgumentError(field, prompt_ids, "at least 1 token")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidArgumentError(
                field,
                f"<{len(prompt_ids)} tokens>",
                f"at most {self.max_model_len - 1} tokens (max_model_len={self.max_model_len})",
            )
        kinds = set(map(type, prompt_ids))  # (numpy's integers too; never bools or floats)
        integers = all(issubclass(t, numbers.Integral) and t is not bool for t in kinds)
        if not integers or min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidArgumentError(field, "token ids", f"integer ids in [0, {self.vocab_size - 1}]")

    def check_params(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        for field, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidArgumentError(field, bad[0], f"token ids in [0, {vocab - 1}]")
        stops = params.stop_strings
        if len(stops) > self.max_stop_strings:
            raise InvalidArgumentError("stop", f"<{len(stops)} strings>", f"at most {self.max_stop_strings}")
        longest = max(stops, key=len, default="")
        if len(longest) > self.max_stop_string_length:
            raise InvalidArgumentError(
                "stop",
                f"<{len(longest)} characters>",
                f"strings of at most {self.max_stop_string_length} characters",
            )
        if params.structured_outputs is not None:
            self._check_grammar(params.structured_outputs)

    def _check_grammar(self, so) -> None:
        """Bounded size and nesting, checked without recursion (a schema nested a thousand
        deep must not reach a recursive encoder: Ray's pickling of it, or json.dumps)."""
        field = f"structured_outputs.{so.kind}"
        value = getattr(so, so.kind)
        if isinstance(value, str) and so.kind == "json":
            if len(value.encode()) > self.max_grammar_bytes:
                raise InvalidArgumentError(field, "<schema>", f"at most {self.max_grammar_bytes} bytes")
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise InvalidArgumentError(field, "<schema>", "a JSON schema (valid JSON text)") from None
        depth = nesting_depth(value, self.max_grammar_depth)
        if depth > self.max_grammar_depth:
            raise InvalidArgumentError(
                field, f"<nested {depth}+ deep>", f"at most {self.max_grammar_depth} levels"
            )
        if isinstance(value, str):
            size = len(value.encode())
        elif isinstance(value, tuple | list):
            size = sum(len(c.encode()) for c in value)
        elif isinstance(value, dict):
            size = len(json.dumps(value).encode())
        else:
            size = 0
        if size > self.max_grammar_bytes:
            raise InvalidArgumentError(field, f"<{size} bytes>", f"at most {self.max_grammar_bytes} bytes")


def nesting_depth(value, stop_after: int) -> int:
    """How deeply dicts and lists nest in `value` (a scalar: 0), counted iteratively; the
    walk ends early once past `stop_after`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_after:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
