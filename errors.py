"""kvray's exception types: every error a user can act on names the field and what is allowed."""

from __future__ import annotations


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


def check_range(field: str, value, *, low=None, high=None, low_open=False, high_open=False):
    """Raise InvalidArgumentError unless low <= value <= high (with open ends where asked)."""
    bad = False
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        lo = "-inf" if low is None else str(low)
        hi = "inf" if high is None else str(high)
        lb = "(" if low_open or low is None else "["
        hb = ")" if high_open or high is None else "]"
        raise InvalidArgumentError(field, value, f"{lb}{lo}, {hi}{hb}")
