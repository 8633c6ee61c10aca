"""A request as the scheduler sees it: tokens so far and how many of them are computed."""

from __future__ import annotations

import enum
import hashlib
import struct
import time
from dataclasses import dataclass, field

from kvray.engine.sampling_params import SamplingParams
from kvray.engine.structured_outputs import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # something of its own failed in a step (logged); the batch went on

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """Chained hash of one full block: it names the whole prefix up to this block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass
class SampleGroup:
    """The n samples of one prompt. Samples after the first wait until the first has
    computed the prompt, then reuse its full blocks through the prefix cache."""

    num_samples: int
    prompt_done: bool = False


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_size: int
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the `priority` policy
    deadline: float | None = None  # monotonic seconds; earliest first under `deadline`
    sample_index: int = 0  # which of the group's n samples
    group: SampleGroup | None = None
    extra_keys: tuple = ()  # salts every block hash (e.g. an adapter's name)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache at first schedule
    first_scheduled_time: float | None = None  # monotonic; its time in the queue ends here
    first_token_time: float | None = None  # monotonic; when its first output token came
    last_token_time: float | None = None  # monotonic; when its latest output token came
    step_seconds: float = 0.0  # its share of the steps that ran it (step time / batch size)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    # per generated token: (sampled logprob, {token_id: (logprob, rank)}) when logprobs asked
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    grammar: GrammarMatcher | None = None  # where its structured output stands
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for its next step

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._hash_new_blocks()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._hash_new_blocks()

    def _hash_new_blocks(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= self.num_tokens:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.all_token_ids[i * bs : (i + 1) * bs]
            extra = self.extra_keys
            salt = self.sampling_params.cache_salt
            if i == 0 and salt is not None:  # vLLM's rule: the first block's hash, and so the chain
                extra = (("cache_salt", salt), *extra)
            self.block_hashes.append(hash_block(parent, tokens, extra))
