"""Structured outputs, tool calls and the rest of the API through Serve and the official
`openai` client, on the PD app (the prefill samples the first token under the grammar,
the decode worker replays it) and the colocated one.

Every JSON answer is validated with `jsonschema`, regex ones with `re`; forced tool calls
give arguments valid for the function's schema; /tokenize and /detokenize round-trip;
the OpenAPI document names the request fields; unsupported fields are 400s naming them.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from serve_fixtures import API_KEY, MODEL
from structured_schemas import PROMPT, SCHEMAS, compact

openai = pytest.importorskip("openai")

from kvray.engine.structured_outputs import closed_objects  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module", params=["pd", "colocated"])
def api(request, apps):  # noqa: F811
    return openai.OpenAI(base_url=f"{apps[request.param]}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _chat_json(api, schema: dict, stream: bool, temperature: float) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        response_format=fmt,
        max_tokens=200,
        temperature=temperature,
        seed=5,
    )
    if not stream:
        return api.chat.completions.create(**kw).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or "" for c in api.chat.completions.create(stream=True, **kw) if c.choices
    ]
    return "".join(pieces)


def test_json_schemas_hold_streamed_and_not_greedy_and_sampled(api, request):
    """Every schema once per app, the four (streamed?, temperature) cases taken in turn
    (shifted by two on the other app): each case ~3 times per app, each schema in two."""
    cases = [(False, 0.0), (True, 0.7), (True, 0.0), (False, 0.7)]
    shift = 0 if "pd" in request.node.callspec.id else 2
    jobs = [(name, *cases[(i + shift) % 4]) for i, name in enumerate(SCHEMAS)]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda j: _chat_json(api, SCHEMAS[j[0]], j[1], j[2]), jobs))
    for (name, stream, t), text in zip(jobs, texts):
        try:  # strict: the schema exactly (no key it does not list), written compact
            jsonschema.validate(json.loads(text), closed_objects(SCHEMAS[name]))
            assert compact(text)
        except (ValueError, AssertionError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name} stream={stream} temperature={t}: {text!r}") from e


def test_completions_take_response_format_and_structured_outputs(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["nested"]}}
    out = api.completions.create(  # greedy
        model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["nested"])
    obj = api.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,  # any object: unbounded, so greedy (sampled, a small model may ramble on)
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(obj.choices[0].text), dict)
    phone = r"[0-9]{3}-[0-9]{4}"
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.7, n=2, stream=stream)
        out = api.completions.create(**kw, extra_body={"structured_outputs": {"regex": phone}})
        texts = {}
        for c in [out] if not stream else out:
            for choice in c.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert sorted(texts) == [0, 1] and all(re.fullmatch(phone, t) for t in texts.values()), texts
    choice = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Capital of Italy?"}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome", "Berlin"]}},
    )
    assert choice.choices[0].message.content in {"Paris", "Rome", "Berlin"}


def test_forced_tool_calls_have_valid_arguments(api):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,  # unseeded sampling could ramble past max_tokens inside the arguments
    )
    (call,) = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0.7,
        seed=2,
    )
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    # streamed: the calls come as tool-call deltas the client can join
    stream = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0.7,
        seed=2,
        stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and deltas and all(d.function.name == "get_weather" for d in deltas)
    jsonschema.validate(json.loads(deltas[0].function.arguments), WEATHER["function"]["parameters"])
    # the result goes back as a tool message through the chat template
    follow = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C and sunny"},
    ]
    answer = api.chat.completions.create(
        model=MODEL, messages=follow, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def test_a_schema_that_does_not_compile_is_a_400_naming_it(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"structured_outputs": {"regex": "a(b"}},
        )
    assert e.value.body["param"] == "structured_outputs.regex" and "unclosed group" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            },
        )
    assert e.value.body["param"] == "response_format.json"  # named as the client sent it


def test_tokenize_detokenize_round_trip(http):  # noqa: F811
    text = "The capital of France is Paris."
    t = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    assert http.post("/detokenize", json={"model": MODEL, "tokens": t["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > t["count"]  # the chat template's tokens around it
    bad = http.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = http.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "a"}]})
    assert both.status_code == 400


def test_openapi_names_the_request_fields(http):  # noqa: F811
    doc = http.get("/openapi.json").json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    chat = doc["components"]["schemas"][body["$ref"].split("/")[-1]]
    assert {"messages", "response_format", "tools", "tool_choice", "logit_bias"} <= set(chat["properties"])
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "echo", "structured_outputs"} <= set(completion["properties"])
    assert "/tokenize" in doc["paths"] and "/detokenize" in doc["paths"]
    responses = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert responses["$ref"].endswith("/ResponsesRequest")
    fields = set(doc["components"]["schemas"]["ResponsesRequest"]["properties"])
    assert {"input", "instructions", "max_output_tokens", "text", "tools", "previous_response_id"} <= fields


def test_unsupported_fields_are_400s_and_unknown_ones_are_ignored(http):  # noqa: F811
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = http.post("/v1/completions", json={**base, "suffix": " end"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**chat, "audio": {"voice": "alloy"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio"
    assert http.post("/v1/completions", json={**base, "no_such_field": 1}).status_code == 200


def test_echo_logit_bias_and_continuous_usage(client, http):  # noqa: F811
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, echo=True)
    assert out.choices[0].text.startswith("The capital of France is")
    token = http.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][
        0
    ]
    biased = client.completions.create(
        model=MODEL, prompt="I like", max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == " banana" * 3
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        # ignore_eos: a sampled or greedy end-of-turn before 4 tokens would end the usage short
        extra_body={
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True,
        },
    )
    usages = [c.usage.completion_tokens for c in stream if c.usage is not None]
    assert usages == sorted(usages) and usages[-1] == 4 and len(usages) >= 3
