"""Structured outputs: a grammar constrains which tokens a request may sample.

`SamplingParams(structured_outputs=StructuredOutputsParams(json=..., regex=..., choice=...,
grammar=..., json_object=True))` -- vLLM's names. The grammar library is llguidance
(measured on this CPU against xgrammar and outlines-core, `benchmarks/grammar_mask.py`:
the cheapest per-step mask at batch 1 and 32, the fastest compile, no dependencies).

* `GrammarCompiler` turns the params into a validated llguidance grammar, once per
  distinct one (cached; thread-safe, so `AsyncLLM` compiles in a helper thread, off the
  step loop). A grammar that does not compile is an InvalidArgumentError naming the field.
* Each sample of a constrained request holds a `GrammarMatcher`: before the step that
  samples it, the runner asks it for its row of the token bitmask (the sampler applies it
  inside the batched pass, so constrained and free requests share a step); after the
  step the engine advances it by the sampled token. A request whose tokens came from
  elsewhere (a prefill worker's first token, a migrated request's stream) replays them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvray.errors import InvalidArgumentError

if TYPE_CHECKING:  # torch loads only where masks are applied (the scheduler's side never needs it)
    import torch

FORMATS = ("json", "regex", "choice", "grammar", "json_object")
CACHE_ENTRIES = 512  # compiled grammars a GrammarCompiler keeps, least recently used out first
CACHE_BYTES = 64 << 20  # ... and their text (keys and grammars) at most this many bytes
# llguidance's JSON whitespace under disable_any_whitespace: Python's json.dumps separators
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (dict or its JSON text), a regex, a list of choices,
    a grammar (Lark or GBNF/EBNF, llama.cpp's form), or `json_object` (any JSON object).
    `disable_any_whitespace` (the default): JSON as compact JSON with single spaces writes
    it (`{"a": [1, 2]}`: one space after each `,` and `:`, no other whitespace between
    tokens); False: any whitespace there, which a sampling model can fill without end.
    `disable_additional_properties`: a schema's objects that list properties and do not
    say otherwise take only those (OpenAI's `strict: true`; vLLM's option of that name;
    JSON Schema's default, kept without it, lets a model add keys of its own after them)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [f for f in FORMATS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise InvalidArgumentError(
                "structured_outputs", given or None, f"exactly one of {', '.join(FORMATS)}"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidArgumentError(
                    "structured_outputs.choice", self.choice, "a list of non-empty strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(f for f in FORMATS if getattr(self, f) not in (None, False))

    def key(self) -> str:
        """Names the grammar: equal keys, the same compiled grammar."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        flags = f"{int(self.disable_any_whitespace)}{int(self.disable_additional_properties)}"
        return f"{self.kind}:{flags}:{text}"


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; caches by `key()`, least
    recently used first out past `max_entries` grammars or `max_bytes` of their text (every
    request may bring a new schema: an unbounded cache grows with the traffic)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_entries: int = CACHE_ENTRIES,
        max_bytes: int = CACHE_BYTES,
    ):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's view of it, built on first use (about 1 s)
        self._cache: OrderedDict[str, str] = OrderedDict()
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0  # of the cached keys and grammars
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if self.hf_tokenizer is None:
                    raise InvalidArgumentError("structured_outputs", "given", "an engine with a tokenizer")
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The validated llguidance grammar of `params` (raises InvalidArgumentError)."""
        key = params.key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
        if grammar is not None:
            return grammar
        import llguidance

        tokenizer = self.tokenizer
        field = f"structured_outputs.{params.kind}"
        try:
            grammar = _grammar_text(llguidance, params)
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        except (ValueError, TypeError, RecursionError) as e:
            error = str(e) or type(e).__name__
        if error:
            raise InvalidArgumentError(
                field, _short(getattr(params, params.kind)), f"a {params.kind} that compiles ({error})"
            )
        self._remember(key, grammar)
        return grammar

    def _remember(self, key: str, grammar: str) -> None:
        size = len(key) + len(grammar)
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = grammar
            self.num_bytes += size
            while len(self._cache) > self.max_entries or (
                self.num_bytes > self.max_bytes and len(self._cache) > 1
            ):
                old_key, old = self._cache.popitem(last=False)
                self.num_bytes -= len(old_key) + len(old)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        import llguidance

        return GrammarMatcher(llguidance.LLMatcher(self.tokenizer, self.compile(params)), self.vocab_size)

    def __len__(self) -> int:
        return len(self._cache)


class GrammarMatcher:
    """One sample's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def token_bitmask(self) -> torch.Tensor:
        """The tokens it may sample next: int32 [ceil(V / 32)], bit i of word w = token 32w + i."""
        import llguidance.torch

        mask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self._m, mask, 0)
        return mask[0]

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled (or replayed) token; False (and unchanged) if it refuses it."""
        return bool(self._m.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts looked ahead over)."""
        self._m.rollback(num_tokens)

    def num_valid(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` it would accept, in order (unchanged)."""
        return int(self._m.validate_tokens(token_ids)) if token_ids else 0

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing but the end of sequence."""
        return self._m.is_stopped()


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
    """`logits` [B, V] with the tokens each mask forbids set to -inf in its row (a copy)."""
    import torch

    vocab = logits.shape[1]
    words = torch.stack(masks).to(logits.device)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    logits = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def _grammar_text(llguidance, params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object")
        if kind == "json" and params.disable_additional_properties:
            schema = closed_objects(schema)
        overrides = COMPACT if params.disable_any_whitespace else None
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=overrides)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    return llguidance.grammar_from("grammar", params.grammar)


# where a JSON schema holds subschemas: one, a list of them, or a name -> subschema map
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_ONE += ("propertyNames", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """A copy of the JSON schema in which every object schema that lists properties and
    says nothing of `additionalProperties` has it false (its listed properties only)."""
    if not isinstance(schema, dict):
        return schema  # true / false schemas
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    # only where it lists keys, as vLLM: a bare {"type": "object"} stays free-form, and an
    # object made of anyOf / allOf / $ref parts, closed itself, would take no key at all
    lists_keys = "properties" in out or "patternProperties" in out
    if lists_keys and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
