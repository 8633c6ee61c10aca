"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat path.

A Responses request becomes a chat completions body (`to_chat_body`): `instructions` the
system message, `input` text or items (messages, `function_call`, `function_call_output`)
the messages after the conversation its `previous_response_id` names, `text.format` the
response format, function `tools` the chat tools. The chat path validates, tokenizes and
runs it as any chat request; its answer comes back as a Response object (`Reply`,
`response_body`), its stream's chunks as the Responses events (router/responses_route.py).

A stored response (`store`, the default) keeps its whole conversation in `ResponseStore`:
in this ingress replica's memory, bounded, and under the API key that made it, so only
that key can continue it. Fields the API has and kvray does not serve are 400s naming them.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvray.router.api_error import APIError
from kvray.router.request_body import check_body, validate_body

# fields a client may send that change nothing kvray computes
NO_OP = {"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "stream_options"}
# the chat body's field -> the Responses field a client sent it as (errors are named so)
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
STORE_ENTRIES = 1024  # stored responses an ingress replica keeps, least recently used out first
STORE_BYTES = 64 << 20  # ... and their conversations' JSON at most this many bytes
STORE_PER_KEY = 256  # ... and at most this many of one API key


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat = TextFormat()


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = True  # the Responses API's default (Chat Completions' is not strict)


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses (the fields kvray serves)."""

    model_config = ConfigDict(extra="allow")  # named by `unsupported` first, then dropped

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    truncation: Literal["disabled"] = "disabled"  # "auto" (dropping the middle) is not served
    include: list[str] = Field(default_factory=list, max_length=0)  # nothing extra to include
    metadata: dict[str, str] | None = None
    user: str | None = None


def parse_responses_request(body: object) -> ResponsesRequest:
    """A validated body; a field the API has and kvray does not serve (or no API has) is a
    400 naming it."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_body(body)
    for name in sorted(set(body) - set(ResponsesRequest.model_fields) - NO_OP):
        raise APIError(
            400, f"{name}: kvray's /v1/responses does not support it", param=name, code="unsupported_field"
        )
    return validate_body(ResponsesRequest, body)


def to_chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completions body that runs `req` after the conversation `history`."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req.input)
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    for name, value in (
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
    ):
        if value is not None:
            chat[name] = value
    if req.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    if isinstance(req.tool_choice, NamedFunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else TextFormat()
    if fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400, "text.format.schema: a JSON schema is required", param="text", code="invalid_value"
            )
        schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat


def input_messages(given: str | list[dict]) -> list[dict]:
    """`input` as chat messages: text is one user message; items are messages (text, or
    input_text / output_text parts), function calls (an assistant message's tool call) and
    their outputs (a tool message)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role", "one of user, assistant, system, developer")
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _text(item, where)}
            )
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function"}
            call["function"] = {
                "name": _str(item, "name", where),
                "arguments": _str(item, "arguments", where),
            }
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _str(item, "output", where)
            messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": output})
        else:
            raise _bad(f"{where}.type", "message, function_call or function_call_output")
    return messages


def _text(item: dict, where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "text, or a list of input_text / output_text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise _bad(f"{where}.content[{j}].type", "input_text or output_text (kvray serves text only)")
        parts.append(_str(part, "text", f"{where}.content[{j}]"))
    return "".join(parts)


def _str(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad(f"{where}.{name}", "a string")
    return value


def _bad(path: str, allowed: str) -> APIError:
    return APIError(400, f"{path}: allowed {allowed}", param=path.split("[")[0], code="invalid_value")


def renamed(e: APIError) -> APIError:
    """A chat path error, named after the Responses field the client sent (a message's
    error names `input`: the conversation's messages, history and instructions included)."""
    top = (e.param or "").split("[")[0].split(".")[0]
    name = CHAT_FIELDS.get(top)
    if name is not None:
        e.message = e.message.replace(top, name if top != "messages" else "input (as chat messages)", 1)
        e.param = name
    return e


@dataclass
class Reply:
    """What a response answered: its text, its function calls (chat's tool_calls), why it
    ended and its token counts."""

    text: str = ""
    calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def of_chat(cls, chat: dict) -> Reply:
        choice, usage = chat["choices"][0], chat["usage"]
        message = choice["message"]
        return cls(message.get("content") or "", message.get("tool_calls") or [], choice["finish_reason"],
                   usage["prompt_tokens"], usage["completion_tokens"])  # fmt: skip

    @property
    def message_status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def assistant_message(self) -> dict:
        """The reply as the chat message a later turn's conversation holds."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """A message output item; `in_progress` ones have no content yet, `incomplete` ones
    ran into max_output_tokens."""
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status != "in_progress"
        else []
    )
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    arguments = fn["arguments"] if status == "completed" else ""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": arguments, "status": status}  # fmt: skip


def response_body(
    req: ResponsesRequest, rid: str, created: int, reply: Reply | None, items: list[dict]
) -> dict:
    """The Response object: in progress (reply None) or as `reply` ended."""
    status, incomplete = "in_progress", None
    if reply is not None:
        status = "incomplete" if reply.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    usage = None
    if reply is not None:
        usage = {
            "input_tokens": reply.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": reply.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.input_tokens + reply.output_tokens,
        }
    fmt = req.text.format if req.text is not None else TextFormat()
    choice = (
        req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice or "auto"
    )
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": items,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": choice,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools],
        "top_p": req.top_p,
        "truncation": req.truncation,
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def output_items(reply: Reply) -> list[dict]:
    """A finished reply's output: its message (if it wrote text), then each function call."""
    items = (
        [message_item(new_id("msg"), reply.text, reply.message_status)]
        if reply.text or not reply.calls
        else []
    )
    return items + [call_item(new_id("fc"), c) for c in reply.calls]


def key_of(authorization: str | None) -> str:
    """Whose responses: a digest of the request's API key (every caller's the same
    without one)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


class ResponseStore:
    """Stored responses' conversations (chat messages, the reply included) under the API
    key that made them; least recently used out past `max_entries` or `max_bytes` in all,
    or past `max_per_key` of one key (one busy key cannot push out every other's)."""

    def __init__(
        self, max_entries: int = STORE_ENTRIES, max_bytes: int = STORE_BYTES, max_per_key: int = STORE_PER_KEY
    ):
        self.max_entries, self.max_bytes, self.max_per_key = max_entries, max_bytes, max_per_key
        self._entries: OrderedDict[tuple[str, str], tuple[list[dict], int]] = OrderedDict()
        self._per_key: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # the ingest threads and the event loop both reach it

    def get(self, key: str, response_id: str) -> list[dict]:
        with self._lock:
            entry = self._entries.get((key, response_id))
            if entry is None:
                raise APIError(
                    404, f"previous_response_id: no stored response {response_id!r}",
                    param="previous_response_id", code="previous_response_not_found",
                )  # fmt: skip
            self._entries.move_to_end((key, response_id))
            return entry[0]

    def put(self, key: str, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        with self._lock:
            if (key, response_id) in self._entries:
                self._drop((key, response_id))
            self._entries[(key, response_id)] = (messages, size)
            self._bytes += size
            self._per_key[key] = self._per_key.get(key, 0) + 1
            if self._per_key[key] > self.max_per_key:
                self._drop(next(k for k in self._entries if k[0] == key))  # its least recent
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                self._drop(next(iter(self._entries)))

    def _drop(self, entry: tuple[str, str]) -> None:
        _, size = self._entries.pop(entry)
        self._bytes -= size
        self._per_key[entry[0]] -= 1
        if not self._per_key[entry[0]]:
            del self._per_key[entry[0]]

    def __len__(self) -> int:
        return len(self._entries)


def now() -> int:
    return int(time.time())
