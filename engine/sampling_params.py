"""Per-request sampling parameters, vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvray.engine.structured_outputs import StructuredOutputsParams
from kvray.errors import InvalidArgumentError, check_range

_GREEDY_EPS = 1e-5
SEED_MODULUS = 1 << 64  # a torch.Generator takes seeds in [0, 2**64)
MIN_SEED = -(1 << 63)  # seeds in [MIN_SEED, SEED_MODULUS) are taken, mapped modulo 2**64
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` (OpenAI's cap)


def sample_seed(seed: int | None, index: int) -> int | None:
    """The generator seed of sample `index` of a request seeded `seed` (None: unseeded),
    always in the generator's range."""
    return None if seed is None else (seed + index) % SEED_MODULUS


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far, on every output
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request has finished (cumulative)


@dataclass
class SamplingParams:
    n: int = 1  # independent samples of the same prompt (they share its cached blocks)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]
    top_k: int = -1  # -1 (or 0) = all tokens
    min_p: float = 0.0  # drop tokens below min_p * p_max
    presence_penalty: float = 0.0  # OpenAI-style, on generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, on prompt and generated tokens
    seed: int | None = None  # per-request generator: same seed, same tokens (any int64 or uint64)
    stop: str | list[str] | None = None  # stop strings (excluded from the text)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a grammar its tokens follow
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these (vLLM's field)
    # salts the prefix cache (vLLM's field): a prompt is only served from cached blocks that
    # were computed under the same salt, so one tenant cannot time another's prompts
    cache_salt: str | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False)  # stop_token_ids, for lookups

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_set = frozenset(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1
        self._validate()
        if self.seed is not None:
            self.seed %= SEED_MODULUS

    def _validate(self) -> None:
        check_range("n", self.n, low=1)
        check_range("temperature", self.temperature, low=0.0)
        check_range("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_range("top_k", self.top_k, low=-1)
        check_range("min_p", self.min_p, low=0.0, high=1.0)
        check_range("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        check_range("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        check_range("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.max_tokens is not None:
            check_range("max_tokens", self.max_tokens, low=1)
        check_range("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        if self.logprobs is not None:
            check_range("logprobs", self.logprobs, low=0, high=20)
        if self.seed is not None:
            if not _is_int(self.seed):
                raise InvalidArgumentError("seed", self.seed, "an integer")
            check_range("seed", self.seed, low=MIN_SEED, high=SEED_MODULUS - 1)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise InvalidArgumentError("stop", self.stop, "non-empty strings")
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidArgumentError("allowed_token_ids", [], "at least one token id")
            _check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidArgumentError("cache_salt", self.cache_salt, "a non-empty string")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidArgumentError(
                "structured_outputs", self.structured_outputs, "a StructuredOutputsParams"
            )
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidArgumentError(
                "logit_bias", f"<{len(bias)} entries>", f"at most {MAX_LOGIT_BIAS} entries"
            )
        _check_token_ids("logit_bias", list(bias))
        for token, value in bias.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgumentError(f"logit_bias[{token}]", value, "a number in [-100, 100]")
            check_range(f"logit_bias[{token}]", value, low=-100.0, high=100.0)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidArgumentError(
                "output_kind", self.output_kind, "a RequestOutputKind: CUMULATIVE, DELTA or FINAL_ONLY"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(field: str, ids: list) -> None:
    """Token ids are ints >= 0 (whether the model has them: RequestLimits, at intake)."""
    for t in ids:
        if not _is_int(t) or t < 0:
            raise InvalidArgumentError(field, t, "token ids: integers >= 0")
