"""Prompt sets for `kvray bench serve`: English-looking prompts of exact token lengths.

Every prompt is a run of whole-word vocabulary tokens (" river", " charter", ...): tokens
that decode to a space plus lowercase letters and encode back to themselves. A byte-level
BPE splits text at those spaces, so n such tokens decode to text that encodes to exactly n
tokens, and a prefix of k of them followed by a suffix of m encodes to k + m. A fix-up
loop re-measures with the tokenizer anyway (tokenizers without that property converge in
a step or two), so `prompt_len` is the tokenizer's count of the prompt text, without
special tokens.

Datasets (all seeded by `--seed`; the same seed gives the same prompts):

- `random` (vLLM's): input and output lengths uniform in [len*(1-r), len*(1+r)], with a
  shared `--random-prefix-len` prefix before every prompt (prompt_len = prefix + input).
- `sharegpt-synthetic`: ShareGPT-like lengths without the download. Prompt lengths are
  log-normal with median 130 tokens and sigma 1.0, outputs log-normal with median 144 and
  sigma 0.8, both clipped to [4, 1024]: means near 215 and 198 tokens, what vLLM's
  ShareGPT-V3 runs report per request. `--sharegpt-output-len` fixes the output length.
- `shared-prefix`: `--shared-prefix-num-groups` prefixes of `--shared-prefix-len` tokens;
  request i uses prefix i % groups, then a random-* suffix (as `random` draws them).
- `mix`: kvray's reference load, prompts uniform in 32..384 tokens, outputs 16..160.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvray.errors import InvalidArgumentError, check_range

WORD_TOKEN = re.compile(r"^[Ġ▁ ][a-z]{3,12}$")  # byte-level BPE (Ġ) and sentencepiece (▁) spellings
MAX_FIXUPS = 8


@dataclass(frozen=True)
class SampleRequest:
    prompt: str  # the text sent as `prompt` (completions) or the user message (chat)
    prompt_len: int  # tokens in `prompt` by the benchmark's tokenizer, no special tokens
    expected_output_len: int  # sent as max_tokens


@dataclass(frozen=True)
class DatasetArgs:
    """The dataset flags of `kvray bench serve`, one field per flag."""

    num_prompts: int
    seed: int
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    shared_prefix_num_groups: int = 8
    shared_prefix_len: int = 1024
    sharegpt_output_len: int | None = None


class WordVocab:
    """A tokenizer's whole-word tokens, turned into text of an exact token count.

    Built once per tokenizer (filtering the vocabulary takes about a second); the random
    draws come from the generator each call is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.word_ids = np.array(_word_token_ids(tokenizer))
        if len(self.word_ids) < 100:
            raise InvalidArgumentError("tokenizer", tokenizer.name_or_path, "a vocabulary of word tokens")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, rng: np.random.Generator, num_tokens: int, prefix: str = "") -> str:
        """Text t such that prefix + t has count(prefix) + num_tokens tokens."""
        if num_tokens == 0:
            return ""
        target = self.count(prefix) + num_tokens
        ids = rng.choice(self.word_ids, num_tokens).tolist()
        for _ in range(MAX_FIXUPS):
            text = self.tokenizer.decode(ids)
            extra = self.count(prefix + text) - target
            if extra == 0:
                return text
            ids = ids[: len(ids) - extra] if extra > 0 else ids + rng.choice(self.word_ids, -extra).tolist()
        raise InvalidArgumentError("tokenizer", self.tokenizer.name_or_path, "one that round-trips words")


def _word_token_ids(tokenizer) -> list[int]:
    candidates = sorted(i for s, i in tokenizer.get_vocab().items() if WORD_TOKEN.match(s))
    texts = [tokenizer.decode([i]) for i in candidates]
    encoded = tokenizer(texts, add_special_tokens=False).input_ids
    return [i for i, enc in zip(candidates, encoded) if enc == [i]]


def uniform_lens(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """vLLM's random lengths: integers uniform in [floor(len*(1-r)), ceil(len*(1+r))], at least 1."""
    low = max(int(np.floor(length * (1 - range_ratio))), 1)
    high = max(int(np.ceil(length * (1 + range_ratio))), low)
    return rng.integers(low, high + 1, size=n)


def _requests(
    vocab: WordVocab, rng: np.random.Generator, prefixes: list[str], input_lens, output_lens
) -> list[SampleRequest]:
    out = []
    for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
        prefix = prefixes[i % len(prefixes)]
        prompt = prefix + vocab.text(rng, int(n_in), prefix)
        out.append(SampleRequest(prompt, vocab.count(prompt), int(n_out)))
    return out


def random_dataset(a: DatasetArgs, vocab: WordVocab, rng: np.random.Generator) -> list[SampleRequest]:
    check_range("--random-range-ratio", a.random_range_ratio, low=0.0, high=1.0, high_open=True)
    prefix = vocab.text(rng, a.random_prefix_len)
    input_lens = uniform_lens(rng, a.num_prompts, a.random_input_len, a.random_range_ratio)
    output_lens = uniform_lens(rng, a.num_prompts, a.random_output_len, a.random_range_ratio)
    return _requests(vocab, rng, [prefix], input_lens, output_lens)


def shared_prefix_dataset(a: DatasetArgs, vocab: WordVocab, rng: np.random.Generator) -> list[SampleRequest]:
    check_range("--shared-prefix-num-groups", a.shared_prefix_num_groups, low=1)
    check_range("--random-range-ratio", a.random_range_ratio, low=0.0, high=1.0, high_open=True)
    prefixes = [vocab.text(rng, a.shared_prefix_len) for _ in range(a.shared_prefix_num_groups)]
    input_lens = uniform_lens(rng, a.num_prompts, a.random_input_len, a.random_range_ratio)
    output_lens = uniform_lens(rng, a.num_prompts, a.random_output_len, a.random_range_ratio)
    return _requests(vocab, rng, prefixes, input_lens, output_lens)


def sharegpt_synthetic_dataset(
    a: DatasetArgs, vocab: WordVocab, rng: np.random.Generator
) -> list[SampleRequest]:
    input_lens = np.clip(np.rint(rng.lognormal(np.log(130), 1.0, a.num_prompts)), 4, 1024)
    output_lens = np.clip(np.rint(rng.lognormal(np.log(144), 0.8, a.num_prompts)), 4, 1024)
    if a.sharegpt_output_len is not None:
        output_lens = np.full(a.num_prompts, a.sharegpt_output_len)
    return _requests(vocab, rng, [""], input_lens, output_lens)


def mix_dataset(a: DatasetArgs, vocab: WordVocab, rng: np.random.Generator) -> list[SampleRequest]:
    input_lens = rng.integers(32, 384 + 1, size=a.num_prompts)
    output_lens = rng.integers(16, 160 + 1, size=a.num_prompts)
    return _requests(vocab, rng, [""], input_lens, output_lens)


DATASETS: dict[str, Callable[[DatasetArgs, WordVocab, np.random.Generator], list[SampleRequest]]] = {
    "random": random_dataset,
    "sharegpt-synthetic": sharegpt_synthetic_dataset,
    "shared-prefix": shared_prefix_dataset,
    "mix": mix_dataset,
}


def sample_requests(name: str, args: DatasetArgs, vocab: WordVocab) -> list[SampleRequest]:
    """The named dataset's requests, drawn from a generator seeded with `args.seed`."""
    if name not in DATASETS:
        raise InvalidArgumentError("--dataset-name", name, f"one of {sorted(DATASETS)}")
    check_range("--num-prompts", args.num_prompts, low=1)
    return DATASETS[name](args, vocab, np.random.default_rng(args.seed))
