"""What callers ask of AsyncLLM's engine thread (engine/async_engine.py): one typed
command each, queued by any thread and run by the loop thread between steps. Each holds
the futures its caller waits on, so a command that never runs (the engine died first)
fails them (`futures`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvray.engine.outputs import TokenLogprobs


@dataclass(frozen=True)
class AddRequest:
    """A new request (or one moved here from a dead worker, with its generated tokens)."""

    request_id: str
    sink: object  # async_engine.OutputSink
    prompt: object  # llm_engine.PromptInput
    params: object  # SamplingParams
    priority: int
    deadline: float | None
    pin_kv: bool  # a prefill for a decode worker: its blocks stay pinned for the lease
    generated_token_ids: list[int] | None
    matchers: list | None  # structured outputs' grammar matchers, built off the loop
    accepted: Future  # None once the engine took it, or the engine's validation error

    def futures(self) -> list[Future]:
        return [self.accepted]


@dataclass(frozen=True)
class AddPrefilled:
    """A request prefilled elsewhere, continued here once its KV is pulled."""

    request_id: str
    sink: object
    prompt: object
    params: object
    first_token: int
    first_logprobs: TokenLogprobs | None
    matchers: list | None
    pull_deadline: float | None
    accepted: Future
    room: Future  # the blocks to pull the prompt's KV into, or None for no pull
    priority: int = 0

    def futures(self) -> list[Future]:
        return [self.accepted, self.room]


@dataclass(frozen=True)
class Call:
    """fn(*args) on the loop thread, between steps; its result (or error) in `done`."""

    fn: Callable
    args: tuple
    done: Future

    def futures(self) -> list[Future]:
        return [self.done]


@dataclass(frozen=True)
class Abort:
    request_id: str

    def futures(self) -> list[Future]:
        return []


Command = AddRequest | AddPrefilled | Call | Abort
