"""The OpenAI-compatible Serve app (PD preset shape) against the official `openai` client.

The apps of tests/serve_fixtures.py (the PD preset's shape, the colocated one beside it):
greedy answers equal the offline engine's, streamed text equals non-streamed, usage is
right, every bad input gets its status and OpenAI's error body, concurrent streams all
finish, a client that leaves mid-stream frees every block, /metrics counts what was sent,
and the README's handle example runs.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_fixtures import API_KEY, MAX_QUEUED, MODEL, wait_clean, worker_ids, worker_stats  # noqa: E402

from kvray.engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def square(x):\n    return", "Rain falls when"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline(engine_args):
    llm = LLM(**engine_args)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    completions = [o.outputs[0] for o in llm.generate(PROMPTS, greedy)]
    chat = llm.chat(CHAT, greedy)[0].outputs[0]
    return {"completions": completions, "chat": chat, "tokenizer": llm.tokenizer, "llm": llm}


def _metrics(http) -> dict:
    """{(name, frozenset(labels)): value} of every sample on /metrics."""
    text = http.get("/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_completions_match_offline_streamed_and_not(client, offline):
    for prompt, want in zip(PROMPTS, offline["completions"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.prompt_tokens == len(offline["tokenizer"](prompt).input_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason


def _stops(tokenizer, token_ids: list[int]) -> dict[str, str]:
    """Stop strings on a greedy answer: the first token's text, a word in mid text, and a
    string across two tokens (two characters of each)."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    text = "".join(pieces)
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1]) >= 2)
    across = pieces[i][-2:] + pieces[i + 1][:2]
    assert text.find(across) == len("".join(pieces[: i + 1])) - 2  # nowhere earlier
    word = next(p.strip() for p in pieces[2:] if len(p.strip()) >= 3)
    return {"first token": pieces[0], "mid text": word, "across tokens": across}


@pytest.mark.parametrize("app", ["pd", "colocated"])
def test_streamed_text_equals_non_streamed_under_stop_strings(apps, offline, app):
    """The first token obeys the stop strings too (it comes from the prefill worker when
    disaggregated); each answer equals the offline engine's with the same stop string."""
    tok = offline["tokenizer"]
    c = openai.OpenAI(base_url=f"{apps[app]}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    llm = offline["llm"]
    for prompt, full in zip(PROMPTS[:2], offline["completions"][:2]):
        for what, stop in _stops(tok, full.token_ids).items():
            want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[
                0
            ].outputs[0]
            kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}
            plain = c.completions.create(**kwargs).choices[0]
            chunks = [ch for ch in c.completions.create(**kwargs, stream=True) if ch.choices]
            streamed = "".join(ch.choices[0].text for ch in chunks)
            assert plain.text == streamed == want.text, (what, stop, plain.text, streamed)
            assert plain.finish_reason == chunks[-1].choices[0].finish_reason == want.finish_reason


def test_prompt_lists_token_ids_and_n(client, offline):
    tok = offline["tokenizer"]
    ids = tok(PROMPTS[0]).input_ids
    r = client.completions.create(model=MODEL, prompt=[PROMPTS[1], ids], max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [offline["completions"][1].text, offline["completions"][0].text]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, n=2)
    assert [c.text for c in r.choices] == [offline["completions"][2].text] * 2
    assert r.usage.prompt_tokens == len(tok(PROMPTS[2]).input_ids)
    assert r.usage.completion_tokens == 2 * len(offline["completions"][2].token_ids)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs) and "".join(lp.tokens) == r.choices[0].text


def test_chat_sync_and_async_match_offline(client, server, offline):
    want = offline["chat"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want.token_ids)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        plain = await aclient.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, temperature=0
        )
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
        chunks = [c async for c in stream]
        await aclient.close()
        return plain, chunks

    plain, chunks = asyncio.run(run())
    assert plain.choices[0].message.content == want.text
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == want.text
    logprobs = [t for c in with_choices if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(logprobs) == len(want.token_ids) and all(len(t.top_logprobs) == 2 for t in logprobs)
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def _error(r, status: int, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, http):
    good = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    post = http.post
    _error(post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(post("/v1/completions", json={**good, "temperature": -1}), 400, "temperature")
    _error(post("/v1/completions", json={**good, "max_tokens": "many"}), 400, "max_tokens")
    _error(post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    _error(post("/v1/completions", json={**good, "prompt": [999999]}), 400, "prompt")
    _error(post("/v1/completions", json={**good, "prompt": "hi " * 600}), 400, "prompt")
    # no room in the context (max_model_len 512) for the completion asked for
    err = _error(post("/v1/completions", json={**good, "prompt": [42] * 500, "max_tokens": 13}), 400)
    assert err["param"] == "max_tokens" and "at most 12 for a prompt of 500 tokens" in err["message"], err
    assert post("/v1/completions", json={**good, "prompt": [42] * 500, "max_tokens": 12}).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 600}
    _error(post("/v1/chat/completions", json=chat), 400, "max_completion_tokens")
    _error(post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages")
    _error(post("/v1/completions", json={**good, "model": "gpt-4"}), 404, "model")
    err = _error(httpx.post(f"{server}/v1/completions", json=good), 401)
    assert err["type"] == "authentication_error"
    _error(httpx.post(f"{server}/v1/completions", json=good, headers={"Authorization": "Bearer no"}), 401)
    _error(post("/v1/completions", json={**good, "prompt": "x" * (70 << 10)}), 413)
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0).completions.create(
            model=MODEL, prompt="Hi", top_p=0
        )
    r = post("/v1/completions", json=good)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_sixteen_concurrent_streams_complete(server, offline):
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=MODEL, prompt=PROMPTS[i % 3], max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        texts = await asyncio.gather(*(one(aclient, i) for i in range(16)))
        await aclient.close()
        return texts

    texts = asyncio.run(run())
    assert texts == [offline["completions"][i % 3].text for i in range(16)]
    wait_clean()


def _open_stream(server: str, max_tokens: int = 400):
    """A raw streaming request; returns (client, response, lines) after the first data line."""
    c = httpx.Client(base_url=server, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}
    req = c.build_request("POST", "/v1/completions", json={**body, "stream": True})
    r = c.send(req, stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()  # kept open by the caller: a collected iterator closes the response
    assert next(line for line in lines if line.startswith("data:"))
    return c, r, lines


def test_full_queue_503_and_disconnects_free_every_block(server, http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})  # pair group up
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    too_many = http.post("/v1/completions", json={**body, "n": MAX_QUEUED + 1})
    assert _error(too_many, 400)["param"] == "n"  # could never be admitted
    opened = [_open_stream(server) for _ in range(MAX_QUEUED - 1)]
    try:
        # one slot left, but two choices: each choice is an engine request and counts
        assert _error(http.post("/v1/completions", json={**body, "n": 2}), 503)["code"] == "queue_full"
        opened.append(_open_stream(server))
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        err = _error(r, 503)
        assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
        tokenize = http.post("/tokenize", json={"model": MODEL, "prompt": "Hi"})  # admitted as well
        assert _error(tokenize, 503)["code"] == "queue_full"
        assert any(s.used_blocks > 0 for s in worker_stats())
    finally:
        for c, r, _ in opened:  # clients leave mid-stream
            r.close()
            c.close()
    stats = wait_clean()
    assert all(s.num_waiting == 0 for s in stats)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_direct_ingress_answers_and_a_client_leaving_mid_stream_frees_its_blocks(colo_server):
    """The colocated app serves HTTP from its ingress replica (no Serve proxy): /health and
    /v1/models answer there, and streams whose clients leave are aborted on the worker."""
    with httpx.Client(base_url=colo_server, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        assert c.get("/health").json()["workers"]["mixed"]
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
    opened = [_open_stream(colo_server) for _ in range(3)]
    try:
        assert any(s.num_running > 0 and s.used_blocks > 0 for s in worker_stats("colo"))
    finally:
        for c, r, _ in opened:
            r.close()
            c.close()
    wait_clean(app="colo")


def test_metrics_count_what_was_sent(http):
    before = _metrics(http)
    sent_prompt, sent_gen = 0, 0
    for prompt in PROMPTS:
        usage = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
        ).json()["usage"]
        sent_prompt += usage["prompt_tokens"]
        sent_gen += usage["completion_tokens"]
    after = _metrics(http)

    def delta(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert delta("kvray:request_success_total", finished_reason="length") == len(PROMPTS)
    assert delta("kvray:prompt_tokens_total") == sent_prompt
    assert delta("kvray:generation_tokens_total") == sent_gen == 5 * len(PROMPTS)
    assert delta("kvray:time_to_first_token_seconds_count") == len(PROMPTS)
    assert delta("kvray:inter_token_latency_seconds_count") == 4 * len(PROMPTS)
    assert delta("kvray:e2e_request_latency_seconds_count") == len(PROMPTS)
    decode = worker_ids()["decode"]
    assert delta("kvray:kv_transfer_seconds_count", role="decode", worker=decode) == len(PROMPTS)
    assert delta("kvray:kv_transfer_seconds_sum", role="decode") > 0
    assert delta("kvray:request_queue_time_seconds_count") == len(PROMPTS)  # the prefill's queue
    assert delta("kvray:request_generation_tokens_sum") == sent_gen
    assert _total(after, "kvray:kv_transfer_bytes_total", role="decode") > 0
    assert _total(after, "kvray:prefix_cache_queries_total", role="prefill") > 0
    assert delta("kvray:request_cost_usd_sum") > 0
    usage_labels = frozenset({("model_name", MODEL), ("role", "decode"), ("worker", decode)})
    assert ("kvray:kv_cache_usage_perc", usage_labels) in after


def test_readme_handle_example_runs(server):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(# handle example\n.*?)```", readme, flags=re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    # on a thread with a deadline: a Serve handle in a test driver has once waited forever
    # (on Serve's router loop thread), and a hang should fail here, not hold CI for its limit
    code = compile(blocks[0], "README.md", "exec")
    runner = threading.Thread(target=exec, args=(code, namespace), daemon=True)
    runner.start()
    runner.join(timeout=300)
    assert not runner.is_alive(), "the README's handle example did not finish in 300 s"
    body = namespace["response"]
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
    assert "".join(namespace["pieces"]) == body["choices"][0]["text"]
    json.dumps(body)


def test_bench_serve_against_the_server_counts_what_metrics_counted(server, http, tmp_path, monkeypatch):
    """`kvray bench serve` (vLLM's flags and result keys) against this server: what it
    completed and the tokens it got are what /metrics counted meanwhile."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    bench = importlib.import_module("serve")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    before = _metrics(http)
    argv = [
        "--base-url", server, "--model", MODEL, "--tokenizer", str(offline_path()),
        "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
        "--num-prompts", "6", "--max-concurrency", "3", "--ignore-eos", "--seed", "1",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    for key in ("duration", "completed", "request_throughput", "output_throughput", "mean_ttft_ms",
                "p99_itl_ms", "median_tpot_ms", "p90_e2el_ms", "input_lens", "output_lens"):  # fmt: skip
        assert key in result, key
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 36
    deadline = time.monotonic() + 10  # other replicas publish their metrics every second
    while True:
        after = _metrics(http)
        done = _total(after, "kvray:request_success_total") - _total(before, "kvray:request_success_total")
        if done >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done == result["completed"]
    gen = _total(after, "kvray:generation_tokens_total") - _total(before, "kvray:generation_tokens_total")
    assert gen == result["total_output_tokens"]
    prompt = _total(after, "kvray:prompt_tokens_total") - _total(before, "kvray:prompt_tokens_total")
    assert prompt == result["total_input_tokens"]


def offline_path():
    from kvray.models.loader import resolve_model_path

    return resolve_model_path(MODEL)


def test_a_request_past_its_deadline_is_aborted_everywhere(client, http):
    """`request_timeout_s` (a body field; the server default is router.request_timeout_s):
    no output yet -> 408; mid-stream -> the stream ends with finish_reason "abort". Either
    way the blocks are freed on both workers."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    r = http.post("/v1/completions", json={**body, "request_timeout_s": 0.001})
    assert _error(r, 408)["type"] == "timeout_error"
    stream = client.completions.create(
        model=MODEL,
        prompt=body["prompt"],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True, "request_timeout_s": 5.0},
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "abort"
    assert 0 < sum(1 for c in chunks if c.choices[0].text) < 400
    r = http.post("/v1/completions", json={**body, "request_timeout_s": -1})
    assert _error(r, 400)["param"] == "request_timeout_s"
    # at once, not when the prefill's lease (30 s) would have let its pin go
    wait_clean(timeout=10)
