"""One request fails alone, served: poison requests while others stream, and failures of
every part of the app under streaming load.

On the PD app of tests/serve_fixtures.py (Serve's proxy) four greedy streams run while
bad bodies arrive, streamed and not: each gets a 400 naming its field, and the four
finish token-identical to the offline engine. A request that breaks inside a step (a
fault put into the decode worker's engine: a test double of a validation bug) ends with
one OpenAI error event and [DONE] (streamed) or a 500 that names the request and not the
cause; the others stream on. A client of the direct-ingress app that leaves a
non-streaming request aborts it.

On an app of its own (two mixed workers, Serve's proxy): a worker's engine that hangs
past step_timeout_s, and one whose loop dies, fail their requests over to the other
worker (the streams equal the offline engine's) and Serve replaces them; the Router
killed while requests route delays them but loses none, and /health answers meanwhile;
the ingress replica killed with streams in flight: their requests are aborted on the
workers, and a new replica serves.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402
from serve_fixtures import API_KEY, MODEL  # noqa: E402

from kvray.engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a town by the sea,",
    "Rain falls",
]
MAX_TOKENS = 96
HEADERS = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}


@pytest.fixture(scope="module")
def offline(engine_args) -> list[str]:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(**engine_args).generate(PROMPTS, greedy)]


def _stream_text(base: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(c.choices[0].text for c in stream if c.choices)


def _under_load(base: str, disturb, prompts=PROMPTS) -> list[str]:
    """Stream every prompt at once; `disturb()` once they have started; the texts."""
    texts: dict[int, str] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            texts[i] = _stream_text(base, prompts[i])
        except Exception as e:  # noqa: BLE001 (any failure fails the test)
            errors.append(f"{prompts[i]!r}: {e!r}")

    clients = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for c in clients:
        c.start()
    time.sleep(1.0)
    disturb()
    for c in clients:
        c.join(timeout=600)
    assert not errors, errors
    return [texts[i] for i in range(len(prompts))]


def _deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


GOOD = f'"model": "{MODEL}", "prompt": "Hello", "max_tokens": 4'
DEEP = json.dumps(_deep(40))
# raw JSON bodies (NaN and Infinity are what json.loads takes), and the field each names
POISON = [
    (GOOD + ', "stop_token_ids": [-100000], "min_tokens": 2', "stop_token_ids"),
    (GOOD + ', "stop_token_ids": [49152]', "stop_token_ids"),
    (GOOD + ', "seed": 18446744073709551616', "seed"),
    (GOOD + ', "seed": -9223372036854775809', "seed"),
    (GOOD + ', "temperature": NaN', "temperature"),
    (GOOD + ', "top_p": Infinity', "top_p"),
    (GOOD + ', "request_timeout_s": Infinity', "request_timeout_s"),
    (GOOD + ', "request_timeout_s": 1e9', "request_timeout_s"),
    (GOOD + ', "logit_bias": {"49152": 5}', "logit_bias"),
    (GOOD + ', "logit_bias": {"7": NaN}', "logit_bias"),
    (GOOD + ', "logit_bias": ' + json.dumps({str(i): 1 for i in range(301)}), "logit_bias"),
    (GOOD + ', "allowed_token_ids": [1, 99999]', "allowed_token_ids"),
    (GOOD + ', "stop": ' + json.dumps(["x"] * 17), "stop"),
    (GOOD + ', "stop": ' + json.dumps(["x" * 300]), "stop"),
    (GOOD + ', "structured_outputs": {"regex": "(unclosed"}', "structured_outputs.regex"),
    (GOOD + ', "structured_outputs": {"json": ' + DEEP + "}", "structured_outputs.json"),
    (
        GOOD
        + ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
        + DEEP
        + "}}",
        "response_format.json",
    ),
    (GOOD + ', "metadata": ' + "[" * 150 + "]" * 150, "metadata"),
    (f'"model": "{MODEL}", "prompt": [99999], "max_tokens": 4', "prompt"),
]


def _error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_poison_bodies_get_400s_naming_the_field_while_streams_run(server, offline):
    named = {}

    def poison():
        with httpx.Client(base_url=server, timeout=60, headers=HEADERS) as c:
            for body, field in POISON:
                for stream in ("", ', "stream": true'):
                    err = _error(c.post("/v1/completions", content="{" + body + stream + "}"), 400)
                    named[(field, bool(stream))] = err["param"]
            too_deep = (
                "{" + GOOD + ', "metadata": ' + "[" * 5000 + "]" * 5000 + "}"
            )  # past the parser's own limit
            assert _error(c.post("/v1/completions", content=too_deep), 400)["code"] == "invalid_json"
            deep = {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(40)}}
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "response_format": deep}
            named[("chat", False)] = _error(c.post("/v1/chat/completions", json=chat), 400)["param"]

    assert _under_load(server, poison) == offline
    assert named == {(f, s): f for _, f in POISON for s in (False, True)} | {
        ("chat", False): "response_format.json"
    }


def _decode_worker(app: str = "kvray", role: str = "decode"):
    pools = serve.get_deployment_handle(f"{app}-router", app).live_workers.remote().result(timeout_s=30)
    return ray.get_actor(f"{app}-{pools[role][0]}")


MARKER = "Poison pill:"


def _break_on_third_token(worker) -> None:
    """Put a fault into the worker's engine: a request whose prompt starts with MARKER fails
    at its third token, inside the step (where a validation bug would make it fail)."""

    def install(w):
        engine = w.llm.engine
        marker = engine.tokenizer(MARKER).input_ids
        real = type(engine.outputs).on_token.__get__(engine.outputs)

        def on_token(sample, logprobs):
            if sample.prompt_token_ids[: len(marker)] == marker and sample.num_output_tokens >= 3:
                raise RuntimeError("secret internal detail")
            return real(sample, logprobs)

        engine.outputs.on_token = on_token

    ray.get(worker.__ray_call__.remote(install))


def _heal(worker) -> None:
    def remove(w):
        del w.llm.engine.outputs.on_token

    ray.get(worker.__ray_call__.remote(remove))


def test_a_request_failing_inside_a_step_gets_an_error_event_and_done_while_others_stream(server, offline):
    worker = _decode_worker()
    _break_on_third_token(worker)
    seen = {}

    def poison():
        body = {"model": MODEL, "prompt": MARKER + " tell me", "max_tokens": 20, "ignore_eos": True}
        with httpx.Client(base_url=server, timeout=60, headers=HEADERS) as c:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                seen["events"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            seen["plain"] = c.post("/v1/completions", json=body)

    try:
        assert _under_load(server, poison) == offline
    finally:
        _heal(worker)
    *chunks, error, done = seen["events"]
    assert done == "[DONE]"
    err = json.loads(error)["error"]
    assert err["type"] == "internal_server_error" and "secret" not in err["message"]
    assert len(chunks) >= 1 and all("choices" in json.loads(c) for c in chunks)  # tokens before the failure
    plain = _error(seen["plain"], 500)
    assert plain["type"] == "internal_server_error" and "cmpl-" in plain["message"]
    assert "secret" not in plain["message"] and "RuntimeError" not in plain["message"]


def _metric(base: str, name: str, **labels) -> float:
    text = httpx.get(f"{base}/metrics", headers=HEADERS, timeout=30).text
    want = set(labels.items())
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and want <= set(s.labels.items())
    )


@pytest.mark.parametrize("app", ["pd", "colocated"])
def test_a_client_that_leaves_a_non_streaming_request_aborts_it(apps, app):
    """Through Serve's proxy (PD) and with direct ingress (colocated: no proxy to notice,
    the ingress watches the connection itself)."""
    base = apps[app]
    if app == "colocated":
        assert httpx.get(f"{base}/metrics", timeout=30).status_code == 401  # metrics_need_api_key
    name = "kvray:request_success_total"
    aborted, finished = _metric(base, name, finished_reason="abort"), _metric(base, name)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, headers=HEADERS, timeout=2.0)
    deadline = time.monotonic() + 120
    while _metric(base, name) == finished:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.5)
    assert _metric(base, name, finished_reason="abort") == aborted + 1


# ---- failures of the app's parts, on an app of its own ------------------------------------


@pytest.fixture(scope="module")
def live(apps, engine_args, server):
    """Two mixed workers behind Serve's proxy at /live, 0.2 CPU each (the session's apps
    hold the rest of the 2 CPUs)."""
    from kvray.router import build_app

    pool = {"num_workers": 2, "num_cpus": 0.2, "torch_threads": 1}
    config = {
        "app_name": "live",
        "model_name": MODEL,
        "engine": {**engine_args, "max_num_seqs": 16},
        "disaggregated": False,
        "mixed": pool,
        "router": {"health_check_seconds": 0.5},
        "api_key": API_KEY,
    }
    serve.run(build_app(config), name="live", route_prefix="/live")
    yield f"{server}/live"
    serve.delete("live")


def _workers(app: str = "live") -> list[str]:
    return (
        serve.get_deployment_handle(f"{app}-router", app).live_workers.remote().result(timeout_s=30)["mixed"]
    )


def _wait_replaced(old: str, timeout: float = 240.0) -> None:
    """Until Serve has replaced worker `old` and both workers are idle and hold no block."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ids = _workers()
            stats = ray.get([ray.get_actor(f"live-{w}").stats.remote() for w in ids], timeout=30)
            if (
                len(ids) == 2
                and old not in ids
                and all(s.num_running == 0 and s.used_blocks == 0 for s in stats)
            ):
                return
        except Exception:  # noqa: BLE001 (a worker is starting or stopping)
            pass
        assert time.monotonic() < deadline, f"{old} was not replaced"
        time.sleep(1)


@pytest.mark.parametrize("how", ["hung step", "dead loop"])
def test_a_worker_whose_engine_fails_hands_its_streams_on_and_is_replaced(live, offline, how):
    """The worker broken is the one with more of the streams (prefix affinity spreads
    them): they move to the other worker and finish as the offline engine's."""
    victim = []

    def hang(w):
        w.llm.step_timeout_s = 2.0
        w.llm.engine.runner.execute = lambda *args: time.sleep(3600)

    def kill_loop(w):
        def broken():
            raise RuntimeError("the loop broke")

        w.llm.engine.expire_kv_leases = broken

    def disturb():
        ids = _workers()
        stats = ray.get([ray.get_actor(f"live-{w}").stats.remote() for w in ids])
        victim.append(max(zip(ids, stats), key=lambda pair: pair[1].num_running)[0])
        actor = ray.get_actor(f"live-{victim[0]}")
        ray.get(actor.__ray_call__.remote(hang if how == "hung step" else kill_loop))

    assert _under_load(live, disturb) == offline
    _wait_replaced(victim[0])


def _kill(part: str) -> list[str]:
    killed = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if part in a["name"]:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
            killed.append(a["name"])
    return killed


def test_the_router_killed_while_requests_route_loses_none_and_health_answers(live, offline):
    """Streams already routed go on (no token passes the Router); requests that arrive
    while it is down wait for Serve's replacement; /health answers meanwhile."""
    late: dict[int, str] = {}
    status = []

    def disturb():
        assert len(_kill("live-router")) == 1
        threads = [
            threading.Thread(target=lambda i=i: late.__setitem__(i, _stream_text(live, PROMPTS[i])))
            for i in range(len(PROMPTS))
        ]
        for t in threads:
            t.start()
        status.append(httpx.get(f"{live}/health", timeout=30).status_code)
        for t in threads:
            t.join(timeout=600)

    assert _under_load(live, disturb) == offline
    assert status[0] in (200, 503)  # an answer, Router or not
    assert [late.get(i) for i in range(len(PROMPTS))] == offline


def test_the_ingress_killed_with_streams_in_flight_aborts_them_on_the_workers(live):
    aborted: list = []

    def count_aborts(w):
        real = w.abort

        async def abort(request_id):
            w.aborted_by_test = getattr(w, "aborted_by_test", []) + [request_id]
            return await real(request_id)

        w.abort = abort

    workers = [ray.get_actor(f"live-{w}") for w in _workers()]
    ray.get([w.__ray_call__.remote(count_aborts) for w in workers])
    cut = []

    def one(prompt):
        try:
            _stream_text(live, prompt, max_tokens=450)
        except Exception as e:  # noqa: BLE001 (the ingress died under it: expected)
            cut.append(e)

    clients = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while sum(s.num_running for s in ray.get([w.stats.remote() for w in workers])) < len(PROMPTS):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert len(_kill("live-ingress")) == 1
    for c in clients:
        c.join(timeout=300)
    assert len(cut) == len(PROMPTS)  # their streams were cut: their owner is gone
    deadline = time.monotonic() + 120
    while True:
        stats = ray.get([w.stats.remote() for w in workers])
        if all(s.num_running == 0 and s.used_blocks == 0 for s in stats):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)
    for w in workers:
        aborted += ray.get(w.__ray_call__.remote(lambda w: getattr(w, "aborted_by_test", [])))
    assert len(aborted) == len(PROMPTS)  # aborted, not run to max_tokens
    deadline = time.monotonic() + 120
    while True:  # Serve starts a new ingress replica, which serves
        try:
            assert _stream_text(live, PROMPTS[0], max_tokens=4)
            break
        except Exception:  # noqa: BLE001 (not up yet)
            assert time.monotonic() < deadline
            time.sleep(1)
