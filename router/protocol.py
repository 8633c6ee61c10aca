"""OpenAI's request bodies (validated here) and their mapping to SamplingParams.

Everything a client can get wrong becomes an `APIError` with OpenAI's body
`{"error": {"message", "type", "param", "code"}}` and an HTTP status; nothing reaches the
workers unvalidated. A known OpenAI field that kvray cannot honour is a 400 naming it
(`UNSUPPORTED`); a field no API knows is ignored with one warning line, as vLLM does.

Structured outputs come from `response_format` (OpenAI's `json_object` / `json_schema`),
vLLM's `structured_outputs` extra, or a forced tool call (`tool_choice` `required` or a
named function: the JSON schema of the functions' parameters); at most one of them.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvray.engine import SamplingParams, StructuredOutputsParams
from kvray.engine.structured_outputs import closed_objects
from kvray.errors import InvalidArgumentError
from kvray.router.api_error import APIError
from kvray.router.request_body import check_body, validate_body

logger = logging.getLogger(__name__)

# OpenAI fields kvray does not implement: a 400 naming the field, never a silent drop
UNSUPPORTED = {
    "suffix": "completions with a suffix (fill-in-the-middle)",
    "best_of": "best_of (use n)",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "functions": "the deprecated functions field (use tools)",
    "function_call": "the deprecated function_call field (use tool_choice)",
    "reasoning_effort": "reasoning_effort (no reasoning model is served)",
}
# fields OpenAI accepts that change nothing a server computes
ACCEPTED_NO_OP = {"store", "metadata", "service_tier"}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk, not only the last


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extra (exactly one of the first five)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True  # compact JSON (kvray's default; False: free whitespace)
    disable_additional_properties: bool = False

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
            disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties,
        )


class _SamplingRequest(BaseModel):
    # unknown fields are kept here to be named in one warning line (see `warn_unknown`)
    model_config = ConfigDict(extra="allow", populate_by_name=True)

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
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's extra: sample only among these
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefix cache only under this salt
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's extra
    # kvray: abort the request this many seconds after it arrived (server default:
    # router.request_timeout_s)
    request_timeout_s: float | None = Field(None, gt=0)
    # vLLM's: under the pools' `scheduling_policy: priority`, lower runs first (ties by
    # arrival); any other value than 0 needs that policy
    priority: int = 0

    def unknown_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - ACCEPTED_NO_OP)

    def structured_params(self) -> StructuredOutputsParams | None:
        """The request's grammar, from whichever field gives one (at most one may)."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", _from_response_format(self.response_format)))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.params()))
        if len(given) > 1:
            raise InvalidArgumentError(
                "structured_outputs", "with response_format", "one of response_format or structured_outputs"
            )
        return given[0][1] if given else None

    @property
    def grammar_field(self) -> str:
        """The body field that gave the request its grammar (errors in it are named so)."""
        given = self.response_format is not None and self.response_format.type != "text"
        return "response_format" if given else "structured_outputs"

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): float(v) for k, v in self.logit_bias.items()}
        except ValueError:
            raise InvalidArgumentError(
                "logit_bias", self.logit_bias, "token ids (as strings) as keys"
            ) from None

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
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            cache_salt=self.cache_salt,
            structured_outputs=self.structured_params(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str | list[int]]  # one prompt, or a batch of them
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_params(self) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            raise InvalidArgumentError("echo", self.echo, "false with logprobs (no prompt logprobs)")
        return self.sampling_params(self.max_tokens, self.logprobs)


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result answers this call

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it (tool-call arguments as objects)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            m["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return m


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def to_params(self) -> SamplingParams:
        top = self.top_logprobs
        if top is not None and not self.logprobs:
            raise InvalidArgumentError("top_logprobs", top, "only with logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (top or 0) if self.logprobs else None)

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named (OpenAI's default: auto with tools, none without)."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def forced_function(self) -> FunctionDefinition | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        for t in self.tools or []:
            if t.function.name == name:
                return t.function
        known = [t.function.name for t in self.tools or []]
        raise InvalidArgumentError("tool_choice", name, f"the name of a function in tools: {known}")

    @property
    def grammar_field(self) -> str:
        return "tools" if self.tool_mode in ("required", "named") else super().grammar_field

    def structured_params(self) -> StructuredOutputsParams | None:
        mode = self.tool_mode
        if mode in ("auto", "required", "named") and not self.tools:
            raise InvalidArgumentError("tool_choice", mode, "none without tools")
        if mode not in ("required", "named"):
            return super().structured_params()
        if super().structured_params() is not None:
            raise InvalidArgumentError(
                "tool_choice", mode, "auto or none when response_format or structured_outputs is given"
            )
        if mode == "named":
            return StructuredOutputsParams(json=_parameters(self.forced_function()))
        calls = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t.function)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
        }
        schema = {"type": "array", "items": calls, "minItems": 1}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)  # compact, as every JSON grammar by default


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def _parameters(f: FunctionDefinition) -> dict:
    """A function's arguments schema; under `strict: true` its objects take their listed
    properties only (OpenAI's strict function calling)."""
    schema = f.parameters or {"type": "object", "properties": {}}
    return closed_objects(schema) if f.strict else schema


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise InvalidArgumentError("response_format.json_schema", None, "{name, schema, strict}")
    strict = bool(fmt.json_schema.strict)  # OpenAI's: the schema exactly, no keys beyond it
    return StructuredOutputsParams(json=fmt.json_schema.json_schema, disable_additional_properties=strict)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_request(body: object, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """Validate a decoded JSON body; a bad field becomes a 400 naming it in `param`."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_body(body)
    model = ChatCompletionRequest if chat else CompletionRequest
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], ["text"]) and not (name == "best_of" and body[name] == 1):
            raise APIError(
                400, f"{name}: kvray does not support {what}", param=name, code="unsupported_field"
            )
    req = validate_body(model, body)
    unknown = req.unknown_fields()
    if unknown:
        logger.warning("kvray: ignoring unknown request fields %s", ", ".join(unknown))
    return req
