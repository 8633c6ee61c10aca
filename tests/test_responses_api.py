"""The Responses API's translation to and from the chat path, its stream events and its
store (router/responses_api.py, router/responses_route.py), without a server: hand-made
bodies and chat chunks in, the chat body, Response objects and events checked by hand."""

from __future__ import annotations

import asyncio

import pytest

from kvray.router.api_error import APIError
from kvray.router.responses_api import (
    Reply,
    ResponseStore,
    input_messages,
    key_of,
    output_items,
    parse_responses_request,
    renamed,
    response_body,
    to_chat_body,
)
from kvray.router.responses_route import ResponseEvents, ResponsesRoute

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def _req(**body):
    return parse_responses_request({"model": "m", "input": "hi", **body})


def test_a_request_becomes_the_chat_body_that_runs_it():
    req = _req(
        instructions="Be brief.",
        max_output_tokens=20,
        temperature=0.5,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
        metadata={"a": "b"},
    )
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    chat = to_chat_body(req, history)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        *history,
        {"role": "user", "content": "hi"},
    ]
    assert chat["max_tokens"] == 20 and chat["temperature"] == 0.5 and "top_p" not in chat
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False and not chat["stream"]
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }
    assert to_chat_body(_req(stream=True), [])["stream_options"] == {"include_usage": True}
    loose = {"type": "function", "name": "f"}  # strict unless it says otherwise (the Responses API's default)
    assert to_chat_body(_req(tools=[loose]), [])["tools"][0]["function"]["strict"] is True
    assert to_chat_body(_req(text={"format": {"type": "json_object"}}), [])["response_format"] == {
        "type": "json_object"
    }


def test_input_items_become_messages_tool_calls_and_tool_results():
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]  # fmt: skip
    assert input_messages(items) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),  # a field of the API kvray does not serve
        ({"background": True}, "background"),
        ({"made_up": 1}, "made_up"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ],
)
def test_what_kvray_does_not_serve_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        to_chat_body(_req(**body), [])
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_chat_errors_are_named_after_the_responses_fields():
    e = renamed(APIError(400, "max_tokens=9999 is invalid: allowed [1, 512]", param="max_tokens"))
    assert (e.param, e.message) == (
        "max_output_tokens",
        "max_output_tokens=9999 is invalid: allowed [1, 512]",
    )
    assert renamed(APIError(400, "response_format: bad", param="response_format")).param == "text.format"
    assert renamed(APIError(400, "seed: bad", param="seed")).param == "seed"
    e = renamed(APIError(400, "messages[2].content: bad", param="messages[2].content"))
    assert e.param == "input" and e.message.startswith("input (as chat messages)[2]")


def test_a_reply_becomes_the_response_object():
    req = _req(max_output_tokens=5, tools=[WEATHER])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    message = {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    chat = {
        "choices": [{"message": message, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 5},
    }
    reply = Reply.of_chat(chat)
    body = response_body(req, "resp_1", 100, reply, output_items(reply))
    assert body["status"] == "completed" and body["incomplete_details"] is None
    message, fc = body["output"]
    assert message["type"] == "message" and message["content"][0] == {
        "type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []
    }  # fmt: skip
    assert (fc["type"], fc["call_id"], fc["name"], fc["arguments"]) == (
        "function_call", "call_1", "get_weather", '{"city": "Oslo"}'
    )  # fmt: skip
    assert body["usage"]["input_tokens"] == 7 and body["usage"]["total_tokens"] == 12
    assert reply.assistant_message() == {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    cut = Reply("abc", [], "length", 3, 5)
    body = response_body(req, "resp_2", 100, cut, output_items(cut))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["output"][0]["content"][0]["text"] == "abc"


def test_a_chat_stream_becomes_the_responses_events():
    events = ResponseEvents(_req(), "resp_1", 100)
    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "lo"}, "finish_reason": None}]},
        {"choices": [{"delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}},
    ]
    out = events.started() + [e for c in chunks for e in events.on_chunk(c)] + events.finished()
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta") == "Hello"
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][1]["call_id"] == "call_9"
    assert final["usage"]["output_tokens"] == 3 and out[0]["response"]["status"] == "in_progress"
    broken = ResponseEvents(_req(), "resp_2", 100)
    broken.started()
    broken.on_chunk(chunks[0])
    error = {"error": {"message": "the worker failed", "type": "x", "param": None, "code": "internal_error"}}
    failed = broken.failed(error)
    assert [e["type"] for e in failed] == ["error", "response.failed"]
    assert (
        failed[1]["response"]["status"] == "failed"
        and failed[1]["response"]["error"]["code"] == "internal_error"
    )


def test_the_store_keeps_conversations_per_api_key_and_bounded():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    alice, bob = key_of("Bearer a"), key_of("Bearer b")
    store.put(alice, "r1", [{"role": "user", "content": "1"}])
    assert store.get(alice, "r1") == [{"role": "user", "content": "1"}]
    with pytest.raises(APIError) as e:  # another key cannot continue it
        store.get(bob, "r1")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    store.put(alice, "r2", [])
    store.get(alice, "r1")  # used: r2 is now the least recent
    store.put(alice, "r3", [])
    assert len(store) == 2 and store.get(alice, "r1") is not None
    with pytest.raises(APIError):
        store.get(alice, "r2")
    quota = ResponseStore(max_entries=10, max_per_key=2)
    for i in range(3):
        quota.put(alice, f"a{i}", [])
    quota.put(bob, "b0", [])
    with pytest.raises(APIError):  # alice's oldest made room for her third, not bob's
        quota.get(alice, "a0")
    assert quota.get(alice, "a2") == [] and quota.get(bob, "b0") == [] and len(quota) == 3
    small = ResponseStore(max_entries=10, max_bytes=100)
    small.put(alice, "big", [{"content": "x" * 60}])
    small.put(alice, "bigger", [{"content": "y" * 60}])  # over 100 bytes together: the first goes
    assert len(small) == 1 and small.get(alice, "bigger")


def test_a_stored_response_continues_and_an_unstored_one_does_not():
    """The route with a scripted chat path: the second turn's chat body holds the first
    turn's conversation and reply, but not its instructions (OpenAI's rule)."""
    seen = []

    async def complete(chat, headers=None):
        seen.append(chat)
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        return {
            "choices": [{"message": {"content": f"reply {len(seen)}"}, "finish_reason": "stop"}],
            "usage": usage,
        }

    async def stream(chat, headers=None):  # not used here
        yield None

    route = ResponsesRoute(complete, stream)

    async def scenario():
        first = await route.answer({"model": "m", "input": "one", "instructions": "Be brief."}, "k")
        second = await route.answer({"model": "m", "input": "two", "previous_response_id": first["id"]}, "k")
        unstored = await route.answer({"model": "m", "input": "x", "store": False}, "k")
        with pytest.raises(APIError):
            await route.answer({"model": "m", "input": "y", "previous_response_id": unstored["id"]}, "k")
        return second

    second = asyncio.run(scenario())
    assert seen[1]["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "two"},
    ]
    assert second["previous_response_id"] and second["output"][0]["content"][0]["text"] == "reply 2"
