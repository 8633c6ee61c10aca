"""Tool calls out of a chat completion's text.

How the text is read depends on the request's `tool_choice` (see `ChatCompletionRequest`):

* `named`: the output was constrained to the function's parameters: it is the arguments.
* `required`: constrained to a JSON array of `{"name", "parameters"}`: one call per item.
* `auto`: free text in the chat template's tool format, vLLM's `--tool-call-parser`
  names: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number)
  or `llama3_json` (the whole reply a JSON object `{"name", "parameters"}`, optionally after
  `<|python_tag|>`; several joined by `;`). Text that does not parse stays content.
* `none`: no tool calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"

    def body(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parser_for_template(chat_template: str | None) -> str:
    """The tool format a chat template teaches its model (hermes when it names none)."""
    template = chat_template or ""
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


class ToolCallParser:
    def __init__(self, mode: str, parser: str = "hermes", function: str | None = None):
        """`mode`: none | auto | required | named; `function`: the named one's name."""
        if parser not in PARSERS:
            raise ValueError(f"tool_call_parser {parser!r}: one of {PARSERS}")
        self.mode, self.parser, self.function = mode, parser, function

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, tool calls) of a finished reply."""
        if self.mode == "named":
            return None, [ParsedToolCall(self.function, _compact(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ParsedToolCall(i["name"], json.dumps(i["parameters"])) for i in items]
            except (ValueError, KeyError, TypeError):
                return text, []  # cut off by max_tokens: not a whole array
        if self.mode != "auto":
            return text, []
        if self.parser == "hermes":
            return _parse_hermes(text)
        return _parse_llama3_json(text)

    def streamable(self, text: str) -> int:
        """How much of an unfinished reply can go out as content now (the rest may be, or
        start, a tool call, and waits for the end)."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode != "auto":
            return len(text)
        if self.parser == "llama3_json":
            head = text.lstrip()
            if not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
                return 0
            return len(text)
        at = text.find(_HERMES_OPEN)
        if at >= 0:
            return at
        for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a tag may be starting
            if _HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _parse_hermes(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
            calls.append(ParsedToolCall(call["name"], json.dumps(call.get("arguments", {}))))
        except (ValueError, KeyError, TypeError):
            return text, []  # a malformed call: the reply stays text
    if not calls:
        return text, []
    content = text[: text.find(_HERMES_OPEN)].strip()
    return content or None, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    try:
        for part in _split_objects(body):
            call = json.loads(part)
            args = call.get("parameters", call.get("arguments", {}))
            calls.append(ParsedToolCall(call["name"], json.dumps(args)))
    except (ValueError, KeyError, TypeError):
        return text, []
    return None, calls


def _split_objects(body: str) -> list[str]:
    """`{...}; {...}` -> the objects' texts (a `;` inside a string does not split)."""
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(body):
        _, end = decoder.raw_decode(body, at)
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return parts


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text  # cut off by max_tokens: what there is
