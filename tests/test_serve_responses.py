"""POST /v1/responses with the official `openai` client's `responses.create`, on the PD
test app (tests/serve_fixtures.py): text against the offline engine's chat answer, the
stream's events, a conversation continued by `previous_response_id` (its token count
against the chat template's), function tools and their outputs, strict JSON, and the
fields kvray does not serve (400s naming them)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
from serve_fixtures import MODEL, wait_clean  # noqa: E402
from structured_schemas import compact  # noqa: E402

from kvray.engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def offline(engine_args):
    llm = LLM(**engine_args)
    yield llm


def _chat(llm, messages: list[dict], max_tokens: int) -> str:
    return llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0].text


def test_text_streamed_and_not_equals_the_offline_chat_answer(client, offline):
    want = _chat(
        offline, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], 16
    )
    kw = dict(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=16, temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 16
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 16
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.done" in kinds and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client, offline):
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    follow = "And of Italy?"
    second = client.responses.create(
        model=MODEL, input=follow, previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow},
    ]
    template = offline.tokenizer.apply_chat_template
    ids = template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert second.usage.input_tokens == len(ids)  # the whole conversation reached the model
    assert second.output_text == _chat(offline, conversation, 8) and second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id)


def test_a_forced_function_call_and_its_output_go_round(client):
    r = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=60
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and r.status == "completed"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and compact(calls[0].arguments)  # strict: the listed key only
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER],
        max_output_tokens=12,
        temperature=0,
    )
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"


def test_strict_json_format(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    r = client.responses.create(
        model=MODEL,
        input=QUESTION + " Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0.7,
    )
    assert set(json.loads(r.output_text)) == {"city"} and compact(r.output_text)


def test_fields_kvray_does_not_serve_are_400s_naming_them(client):
    for kw, param in [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ]:
        body = {"model": MODEL, "input": "Hi", **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**body)
        assert e.value.body["param"] == param, e.value.body
    wait_clean()
