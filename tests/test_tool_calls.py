"""Tool calls read out of scripted replies, whole and streamed, and the request side:
which grammar `tool_choice` forces, and what reaches the chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvray.actors.messages import Delta
from kvray.engine import CompletionOutput
from kvray.errors import InvalidArgumentError
from kvray.router.api_error import APIError
from kvray.router.protocol import ChatCompletionRequest, parse_request
from kvray.router.responses import ResponseBuilder
from kvray.router.tool_calls import ToolCallParser, parser_for_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
HERMES_REPLY = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_replies_give_every_call_and_the_text_before_them():
    content, calls = ToolCallParser("auto", "hermes").parse(HERMES_REPLY)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    # no call, or a malformed one: the reply is text
    assert ToolCallParser("auto", "hermes").parse("Paris is sunny.") == ("Paris is sunny.", [])
    broken = "<tool_call>{'name': get_weather}</tool_call>"
    assert ToolCallParser("auto", "hermes").parse(broken) == (broken, [])


def test_llama3_json_replies():
    parser = ToolCallParser("auto", "llama3_json")
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert _calls(parser.parse(one)[1]) == [("get_weather", {"city": "Rome"})]
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "a;b"}}'
    assert _calls(parser.parse(two)[1]) == [("get_time", {}), ("get_weather", {"city": "a;b"})]
    assert parser.parse("It is noon.") == ("It is noon.", [])


def test_forced_calls_read_the_constrained_output():
    named = ToolCallParser("named", function="get_weather")
    assert _calls(named.parse('{ "city" : "Oslo" }')[1]) == [("get_weather", {"city": "Oslo"})]
    required = ToolCallParser("required")
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Lima"}}]'
    assert _calls(required.parse(text)[1]) == [("get_time", {}), ("get_weather", {"city": "Lima"})]
    assert ToolCallParser("none").parse(HERMES_REPLY) == (HERMES_REPLY, [])


def test_parser_follows_the_chat_template():
    assert parser_for_template("{{ '<|python_tag|>' }}{% if ipython %}") == "llama3_json"
    assert parser_for_template("<tool_call>{{ tool_call | tojson }}</tool_call>") == "hermes"
    assert parser_for_template(None) == "hermes"


class _Tokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _stream(builder: ResponseBuilder, text: str, step: int = 3) -> list[dict]:
    """Feed `text` in deltas of `step` characters (a token each); the last finishes with stop."""
    chunks = []
    for start in range(0, len(text), step):
        done = start + step >= len(text)
        delta = Delta("r", [start], text[start : start + step], None, "stop" if done else None, None)
        chunk = builder.chunk(0, delta, False)
        if chunk is not None:
            chunks.append(chunk["choices"][0])
    return chunks


def test_a_streamed_hermes_reply_sends_the_text_then_whole_calls():
    builder = ResponseBuilder(True, "m", "id", _Tokenizer(), tools=ToolCallParser("auto", "hermes"))
    choices = _stream(builder, HERMES_REPLY)
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content.strip() == "Let me check." and "<tool" not in content
    calls = [t for c in choices for t in c["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"]) for t in calls] == [(0, "get_weather"), (1, "get_time")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert all(t["type"] == "function" and t["id"] for t in calls)
    assert choices[-1]["finish_reason"] == "tool_calls"
    # without a call, the held-back "<tool" tail is sent at the end: nothing lost
    plain = ResponseBuilder(True, "m", "id", _Tokenizer(), tools=ToolCallParser("auto", "hermes"))
    text = "a < b and <tool is not a tag"
    choices = _stream(plain, text, step=2)
    assert "".join(c["delta"].get("content") or "" for c in choices) == text
    assert choices[-1]["finish_reason"] == "stop"


def test_the_whole_body_has_tool_calls_and_their_finish_reason():
    builder = ResponseBuilder(
        True, "m", "id", _Tokenizer(), tools=ToolCallParser("named", function="get_weather")
    )
    body = builder.body({0: CompletionOutput(0, '{"city": "Oslo"}', [1], finish_reason="stop")}, _usage())
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def _usage():
    from kvray.router.responses import Usage

    return Usage(1, 1)


def _chat(**fields) -> ChatCompletionRequest:
    return parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, chat=True)


def test_tool_choice_forces_the_functions_schema():
    named = _chat(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    so = named.to_params().structured_outputs
    assert so.json == WEATHER["function"]["parameters"]
    required = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = required.to_params().structured_outputs.json
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # one call at most without parallel calls
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):  # the parameters follow the function's schema
        jsonschema.validate([{"name": "get_weather", "parameters": {"unit": "c"}}], schema)
    assert _chat(tools=[WEATHER]).to_params().structured_outputs is None  # auto: free text
    assert _chat(tools=[WEATHER]).tool_mode == "auto" and _chat().tool_mode == "none"


def test_strict_schemas_take_their_listed_keys_only_and_every_json_grammar_is_compact():
    """OpenAI's `strict: true`, on a response format and on a function: the schema exactly
    (no keys beyond those listed); without it JSON Schema's default (other keys allowed).
    Every JSON grammar the API builds is compact unless structured_outputs says otherwise."""
    extra = {"city": "Paris", "unit": "c", "mood": "sunny"}  # a key the schema does not list
    for strict in (True, False, None):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]},
        }
        if strict is not None:
            fmt["json_schema"]["strict"] = strict
        so = _chat(response_format=fmt).to_params().structured_outputs
        assert so.disable_any_whitespace and so.disable_additional_properties == bool(strict)
        tool = {**WEATHER, "function": {**WEATHER["function"], "strict": strict}}
        forced = _chat(tools=[tool], tool_choice="required").to_params().structured_outputs
        assert forced.disable_any_whitespace
        call = [{"name": "get_weather", "parameters": extra}]
        if strict:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(call, forced.json)
        else:
            jsonschema.validate(call, forced.json)
    assert (
        _chat(response_format={"type": "json_object"}).to_params().structured_outputs.disable_any_whitespace
    )
    free = {"json": {"type": "object"}, "disable_any_whitespace": False}
    assert not _chat(structured_outputs=free).to_params().structured_outputs.disable_any_whitespace


def test_bad_tool_requests_name_the_field():
    with pytest.raises(InvalidArgumentError, match="tool_choice"):
        _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}).to_params()
    with pytest.raises(InvalidArgumentError, match="tool_choice"):
        _chat(tool_choice="required").to_params()
    with pytest.raises(InvalidArgumentError, match="tool_choice"):
        _chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}).to_params()
    with pytest.raises(APIError) as e:
        _chat(functions=[WEATHER["function"]])
    assert e.value.status == 400 and e.value.param == "functions"


def test_tool_messages_reach_the_template_with_their_ids_and_arguments():
    req = _chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
        ]
    )
    assistant, tool = (m.for_template() for m in req.messages[1:])
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert tool == {"role": "tool", "content": "12 C", "tool_call_id": "c1"}
