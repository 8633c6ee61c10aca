"""OpenAI's request bodies (validated here), its error shape, and the mapping to SamplingParams.

Everything a client can get wrong becomes an `APIError` with OpenAI's body
`{"error": {"message", "type", "param", "code"}}` and an HTTP status; nothing reaches the
workers unvalidated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvray.engine import SamplingParams
from kvray.errors import InvalidArgumentError


class APIError(Exception):
    """An error a client sees as OpenAI's error body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):  # handle callers receive it through Ray with its fields
        args = (self.status, self.message, self.type, self.param, self.code, self.headers)
        return _rebuild_api_error, (type(self), *args)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, e: InvalidArgumentError) -> APIError:
        return cls(400, str(e), param=e.field, code="invalid_value")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields (logit_bias, ...) are ignored

    model: str
    n: int = 1
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # kvray: abort the request this many seconds after it arrived (server default:
    # router.request_timeout_s)
    request_timeout_s: float | None = Field(None, gt=0)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """One sample's parameters (the ingress fans `n` out into n requests)."""
        optional = {
            k: getattr(self, k)
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, k) is not None
        }
        if self.n < 1 or self.n > 128:
            raise InvalidArgumentError("n", self.n, "[1, 128]")
        return SamplingParams(
            **optional,
            n=1,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str | list[int]]  # one prompt, or a batch of them
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidArgumentError("echo", self.echo, "false (echo is not supported)")
        return self.sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_params(self) -> SamplingParams:
        top = self.top_logprobs
        if top is not None and not self.logprobs:
            raise InvalidArgumentError("top_logprobs", top, "only with logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (top or 0) if self.logprobs else None)


def parse_request(body: object, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """Validate a decoded JSON body; a bad field becomes a 400 naming it in `param`."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None


def _rebuild_api_error(cls, status, message, type, param, code, headers) -> APIError:
    return cls(status, message, type=type, param=param, code=code, headers=headers)
