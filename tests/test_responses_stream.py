"""Stream chunks built from deltas (`ResponseBuilder.chunk`): what each delta adds goes out
once, with logprobs whose text offsets continue across chunks, the role (chat) or the echo
(completions) on the first chunk only, and the finish reason on the last."""

from __future__ import annotations

from kvray.actors.messages import Delta
from kvray.engine import CompletionOutput
from kvray.engine.outputs import Logprob
from kvray.router.responses import ResponseBuilder, Usage
from kvray.router.tool_calls import ToolCallParser


class _Tokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) * 2 for i in ids)  # 0 -> "aa", 1 -> "bb", ...


def _entries(ids: list[int]) -> list[dict[int, Logprob]]:
    return [{t: Logprob(-0.25, 1), t + 1: Logprob(-2.0, 2)} for t in ids]


def test_completions_chunks_carry_each_delta_once_with_continuing_offsets():
    builder = ResponseBuilder(False, "m", "cmpl-1", _Tokenizer(), echo={0: "Q: "}, created=7)
    first = builder.chunk(0, Delta("r", [0, 1], "aabb", _entries([0, 1]), None, None), False)
    assert builder.chunk(0, Delta("r", [], "", [], None, None), False) is None  # nothing new
    last = builder.chunk(0, Delta("r", [2], "cc", _entries([2]), "stop", "cc"), True, Usage(3, 3))
    (one,), (two,) = first["choices"], last["choices"]
    assert one["text"] == "Q: aabb" and two["text"] == "cc"  # the echo once, before the first
    assert one["logprobs"] == {
        "tokens": ["aa", "bb"],
        "token_logprobs": [-0.25, -0.25],
        "top_logprobs": [{"aa": -0.25, "bb": -2.0}, {"bb": -0.25, "cc": -2.0}],
        "text_offset": [0, 2],
    }
    assert two["logprobs"]["text_offset"] == [4]  # after the 4 characters already sent
    assert (one["finish_reason"], two["finish_reason"], two["stop_reason"]) == (None, "stop", "cc")
    assert "usage" not in first and last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert last["object"] == "text_completion" and last["created"] == 7


def test_chat_chunks_send_the_role_first_and_empty_deltas_not_at_all():
    builder = ResponseBuilder(True, "m", "chatcmpl-1", _Tokenizer())
    opening = builder.chunk(1, Delta("r", [], "", None, None, None), False)  # a choice's first: its role
    assert opening["choices"] == [
        {"index": 1, "delta": {"content": "", "role": "assistant"}, "logprobs": None, "finish_reason": None,
         "stop_reason": None}
    ]  # fmt: skip
    assert builder.chunk(1, Delta("r", [], "", None, None, None), False) is None
    (choice,) = builder.chunk(1, Delta("r", [3], "dd", _entries([3]), "length", None), False)["choices"]
    assert choice["delta"] == {"content": "dd"} and choice["finish_reason"] == "length"
    (entry,) = choice["logprobs"]["content"]
    assert entry["token"] == "dd" and entry["bytes"] == [100, 100]
    assert [t["token"] for t in entry["top_logprobs"]] == ["dd", "ee"]


def test_the_whole_body_and_the_stream_agree():
    """The body from the cumulative output, the stream from its deltas: the same text and
    logprobs."""
    deltas = [
        Delta("r", [0], "aa", _entries([0]), None, None),
        Delta("r", [1], "bb", _entries([1]), "stop", None),
    ]
    streamed = ResponseBuilder(False, "m", "id", _Tokenizer())
    chunks = [streamed.chunk(0, d, False)["choices"][0] for d in deltas]
    whole = CompletionOutput(0, "aabb", [0, 1], logprobs=_entries([0, 1]), finish_reason="stop")
    (choice,) = ResponseBuilder(False, "m", "id", _Tokenizer()).body({0: whole}, Usage(1, 2))["choices"]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert (
        [o for c in chunks for o in c["logprobs"]["text_offset"]]
        == choice["logprobs"]["text_offset"]
        == [0, 2]
    )


def test_content_that_comes_with_the_tool_calls_in_the_last_delta_is_streamed_before_them():
    """A reply whose words and tool call arrive in one final delta ("Let me look." then a
    hermes call): the content goes out in that chunk with the calls, as the whole body
    has it (it was dropped before)."""
    tools = ToolCallParser("auto", "hermes")
    builder = ResponseBuilder(True, "m", "chatcmpl-2", _Tokenizer(), tools=tools)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    opening = builder.chunk(0, Delta("r", [0], "Sure. ", None, None, None), False)
    assert opening["choices"][0]["delta"] == {"content": "Sure. ", "role": "assistant"}
    final = Delta("r", [1, 2], "Let me look. " + call, None, "stop", None)
    (last,) = builder.chunk(0, final, False)["choices"]
    assert last["delta"]["content"] == "Let me look."
    assert [c["function"]["name"] for c in last["delta"]["tool_calls"]] == ["get_weather"]
    assert last["finish_reason"] == "tool_calls"
    whole = CompletionOutput(0, "Sure. Let me look. " + call, [0, 1, 2], finish_reason="stop")
    body = ResponseBuilder(True, "m", "chatcmpl-2", _Tokenizer(), tools=tools).body({0: whole}, Usage(1, 3))
    assert body["choices"][0]["message"]["content"] == "Sure. Let me look."
