"""Per-request sampling parameters, vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvray.engine.structured_outputs import StructuredOutputsParams
from kvray.errors import InvalidArgumentError, check_range

_GREEDY_EPS = 1e-5


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
    seed: int | None = None  # per-request generator: same seed, same tokens
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
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

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
        if any(not s for s in self.stop_strings):
            raise InvalidArgumentError("stop", self.stop, "non-empty strings")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidArgumentError(
                "structured_outputs", self.structured_outputs, "a StructuredOutputsParams"
            )
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise InvalidArgumentError("logit_bias", token, "token ids >= 0 as keys")
            check_range(f"logit_bias[{token}]", bias, low=-100.0, high=100.0)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidArgumentError(
                "output_kind", self.output_kind, "a RequestOutputKind: CUMULATIVE, DELTA or FINAL_ONLY"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
