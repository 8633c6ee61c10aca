"""kvray's exception types: every error a user can act on names the field and what is allowed."""

from __future__ import annotations

import math


class KvrayError(Exception):
    """Base class of every error kvray raises on purpose."""


class InvalidArgumentError(KvrayError, ValueError):
    """A user-supplied value is outside what kvray accepts.

    `field` is the argument's name as the user wrote it and `allowed` says what would
    have been accepted, so HTTP fronts can map it to an OpenAI-shaped 400 with `param`.
    """

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: allowed {allowed}")

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields intact
        return type(self), (self.field, self.value, self.allowed)


class UnknownModelError(InvalidArgumentError):
    """The `model` argument names no alias, local folder or reachable hub repository."""


class UnsupportedArchitectureError(InvalidArgumentError):
    """The model's Hugging Face architecture has no kvray implementation."""


def no_chat_template() -> InvalidArgumentError:
    """The error of a chat request to a model whose tokenizer has no chat template (a base model)."""
    return InvalidArgumentError(
        "messages",
        "<chat>",
        "a model with a chat template: this one has none (a base model), so send a plain "
        "prompt (completions, `LLM.generate`) or pass chat_template",
    )


def check_range(field: str, value, *, low=None, high=None, low_open=False, high_open=False, allow_inf=False):
    """Raise InvalidArgumentError unless low <= value <= high (with open ends where asked).
    NaN is never in range, nor are infinities unless `allow_inf` (JSON bodies may carry
    them: `json.loads` takes `NaN` and `Infinity`, and NaN compares false with every bound)."""
    bad = isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not allow_inf))
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        lo = "-inf" if low is None else str(low)
        hi = "inf" if high is None else str(high)
        lb = "(" if low_open or low is None else "["
        hb = ")" if high_open or high is None else "]"
        finite = (
            "a finite number in "
            if isinstance(value, float) and not math.isfinite(value) and not allow_inf
            else ""
        )
        raise InvalidArgumentError(field, value, f"{finite}{lb}{lo}, {hi}{hb}")


class EngineDeadError(KvrayError):
    """The engine can no longer serve: a step failed (the forward pass), its loop stopped
    on an error, or a step ran past `step_timeout_s`. Its requests are failed over (their
    fronts move them to other workers) and its worker fails its health check."""


class RequestFailedError(KvrayError):
    """Something of the request's own failed on its worker (its sampling, grammar or
    detokenizing; the cause is in that worker's log, with the request id); the other
    requests went on. It is not moved to another worker."""
