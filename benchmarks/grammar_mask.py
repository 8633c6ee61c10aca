"""Per-step cost of a grammar's token mask on this CPU: xgrammar, llguidance, outlines-core.

Each library constrains B requests to the same JSON schema over SmolLM2's 49,152-token
vocabulary. A step is what the engine does per decode step: fill the B requests' rows of
the token bitmask, apply it to the B x V logits, and advance each matcher by its token
(the tokens of a valid document, so every library walks the same path). Printed: the
compile time of the schema (once per distinct schema; cached by the engine) and the
per-step time at batch 1 and 32, median over the document's tokens.

`--e2e N` then runs N JSON-schema requests through kvray's offline engine (llguidance),
and the same requests unconstrained with the token counts the constrained ones made
(`ignore_eos`), and prints both throughputs: what structured outputs cost end to end.

    python benchmarks/grammar_mask.py [--batch 1 32] [--e2e 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from serve_harness import cpu_banner  # benchmarks/serve_harness.py

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "12345"},
    "active": True,
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, grammar, n: int):
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def step(self, matchers, bitmask, logits, token: int) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.ll.LLMatcher(self.tokenizer, grammar)  # the first matcher builds the parser tables
        return grammar

    def matchers(self, grammar, n: int):
        return [self.ll.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return self.llt.allocate_token_bitmask(n, self.vocab_size)

    def step(self, matchers, bitmask, logits, token: int) -> None:
        for i, m in enumerate(matchers):
            self.llt.fill_next_token_bitmask(m, bitmask, i)
        self.llt.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.consume_token(token), m.get_error()


class LLGuidanceParallel(LLGuidance):
    """llguidance filling the batch's rows on its own thread pool (one call per step)."""

    name = "llguidance"
    label = "llguidance, parallel fill"

    def __init__(self, tokenizer, vocab_size: int):
        super().__init__(tokenizer, vocab_size)
        self.executor = self.ll.LLExecutor()

    def step(self, matchers, bitmask, logits, token: int) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        self.llt.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.consume_token(token), m.get_error()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        from outlines_core import Vocabulary

        decode = _byte_decoder()
        tokens: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for text, i in tokenizer.get_vocab().items():
            if i not in special:
                tokens.setdefault(bytes(decode[c] for c in text), []).append(i)
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(schema)), self.vocabulary)

    def matchers(self, grammar, n: int):
        from outlines_core import Guide

        return [Guide(grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return torch.zeros(n, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def step(self, matchers, bitmask, logits, token: int) -> None:
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        # the same apply as the others': unpack the bits, mask the logits
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
        logits.masked_fill_(~allowed, float("-inf"))
        for g in matchers:
            g.advance(token)


def measure(lib, tokens: list[int], batch: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    grammar = lib.compile(SCHEMA)
    compile_s = time.perf_counter() - t0
    matchers = lib.matchers(grammar, batch)
    bitmask = lib.bitmask(batch)
    logits = torch.randn(batch, lib.vocab_size)
    times = []
    for token in tokens:
        t0 = time.perf_counter()
        lib.step(matchers, bitmask, logits, token)
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times)


def end_to_end(num_requests: int) -> None:
    from kvray.engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model="smollm2-135m-instruct", dtype="float32")
    prompts = [
        f"Describe person number {i} as JSON with name, age, email, tags, address and active."
        for i in range(num_requests)
    ]
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=256, structured_outputs=so)
        for i in range(num_requests)
    ]
    llm.generate(prompts[:2], constrained[:2])  # warm-up: compile, tokenizer tables
    t0 = time.perf_counter()
    outs = llm.generate(prompts, constrained)
    constrained_s = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = sum(_parses(o.outputs[0].text) for o in outs)
    free = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)
    ]
    t0 = time.perf_counter()
    llm.generate(prompts, free)
    free_s = time.perf_counter() - t0
    tokens = sum(lengths)
    print()
    print(f"end to end, offline engine, {num_requests} requests, {tokens} output tokens, fp32:")
    print()
    print("| workload | output tok/s | valid JSON |")
    print("|---|---|---|")
    print(f"| JSON schema (llguidance) | {tokens / constrained_s:.1f} | {valid}/{num_requests} |")
    print(f"| unconstrained, same token counts | {tokens / free_s:.1f} | — |")
    print(f"\nconstrained / unconstrained: {free_s / constrained_s:.2f}")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--e2e", type=int, default=0, help="also run this many requests end to end")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from kvray.models.loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    vocab_size = len(tokenizer)
    tokens = tokenizer(json.dumps(DOCUMENT)).input_ids
    print(f"{cpu_banner()}; torch threads: {torch.get_num_threads()}")
    print(
        f"schema: {len(SCHEMA['properties'])} properties (nested object, array, pattern); "
        f"document: {len(tokens)} tokens"
    )
    print()
    print(
        "| library | version | compile (s) | "
        + " | ".join(f"step at batch {b} (ms)" for b in args.batch)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(args.batch))
    from importlib.metadata import version

    for cls in (XGrammar, LLGuidance, LLGuidanceParallel, OutlinesCore):
        lib = cls(tokenizer, vocab_size)
        results = [measure(lib, tokens, b) for b in args.batch]
        compile_s = results[0][0]
        steps = " | ".join(f"{1e3 * s:.3f}" for _, s in results)
        print(f"| {getattr(cls, 'label', cls.name)} | {version(cls.name)} | {compile_s:.2f} | {steps} |")
    if args.e2e:
        end_to_end(args.e2e)


if __name__ == "__main__":
    main()
