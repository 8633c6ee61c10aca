"""`kvray bench serve` (benchmarks/serve*.py): datasets, vLLM's metric math, and the client
end to end against a small SSE server started here on loopback (a test double: the thing
under test is the load generator, not a model server)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serve  # noqa: E402
import serve_metrics as sm  # noqa: E402
from serve_datasets import DatasetArgs, WordVocab, sample_requests  # noqa: E402

from kvray.errors import InvalidArgumentError, KvrayError  # noqa: E402

CHUNK_TEXT = " hello"  # one token for SmolLM2's tokenizer, so counting text counts chunks


@pytest.fixture(scope="module")
def vocab(smollm2_tokenizer):
    return WordVocab(smollm2_tokenizer)


def token_ids(vocab, text):
    return vocab.tokenizer.encode(text, add_special_tokens=False)


# ---- datasets ---------------------------------------------------------------------------------


def test_random_lengths_exact_within_range_with_shared_prefix(vocab):
    args = DatasetArgs(
        num_prompts=30,
        seed=3,
        random_input_len=40,
        random_output_len=20,
        random_range_ratio=0.25,
        random_prefix_len=12,
    )
    reqs = sample_requests("random", args, vocab)
    assert len(reqs) == 30
    prefix = token_ids(vocab, reqs[0].prompt)[:12]
    for r in reqs:
        ids = token_ids(vocab, r.prompt)
        assert len(ids) == r.prompt_len  # exact, by the tokenizer
        assert 30 <= r.prompt_len - 12 <= 50  # [40*0.75, 40*1.25]
        assert 15 <= r.expected_output_len <= 25
        assert ids[:12] == prefix
    assert len({r.prompt_len for r in reqs}) > 1
    fixed = sample_requests("random", DatasetArgs(num_prompts=5, seed=0, random_input_len=33), vocab)
    assert [r.prompt_len for r in fixed] == [33] * 5
    assert [r.expected_output_len for r in fixed] == [128] * 5
    assert all(r.prompt.split() and r.prompt.replace(" ", "").isalpha() for r in fixed)  # English-looking


def test_datasets_are_seeded(vocab):
    args = DatasetArgs(num_prompts=8, seed=7, random_input_len=20, shared_prefix_len=30)
    for name in ("random", "mix", "sharegpt-synthetic", "shared-prefix"):
        a = sample_requests(name, args, vocab)
        b = sample_requests(name, args, vocab)
        c = sample_requests(name, replace(args, seed=8), vocab)
        assert a == b, name
        assert a != c, name


def test_shared_prefix_groups_really_share(vocab):
    args = DatasetArgs(
        num_prompts=9, seed=1, shared_prefix_num_groups=3, shared_prefix_len=50, random_input_len=10
    )
    reqs = sample_requests("shared-prefix", args, vocab)
    prefixes = [token_ids(vocab, r.prompt)[:50] for r in reqs]
    for i, r in enumerate(reqs):
        assert r.prompt_len == 60 == len(token_ids(vocab, r.prompt))
        assert prefixes[i] == prefixes[i % 3]
    assert len({tuple(p) for p in prefixes}) == 3
    assert len({r.prompt for r in reqs}) == 9  # suffixes differ


def test_mix_and_sharegpt_synthetic_ranges(vocab):
    mix = sample_requests("mix", DatasetArgs(num_prompts=40, seed=0), vocab)
    assert all(32 <= r.prompt_len <= 384 and 16 <= r.expected_output_len <= 160 for r in mix)
    assert all(r.prompt_len == len(token_ids(vocab, r.prompt)) for r in mix)
    share = sample_requests("sharegpt-synthetic", DatasetArgs(num_prompts=40, seed=0), vocab)
    assert all(4 <= r.prompt_len <= 1024 and 4 <= r.expected_output_len <= 1024 for r in share)
    fixed = sample_requests(
        "sharegpt-synthetic", DatasetArgs(num_prompts=4, seed=0, sharegpt_output_len=9), vocab
    )
    assert [r.expected_output_len for r in fixed] == [9] * 4


def test_dataset_argument_errors(vocab):
    with pytest.raises(InvalidArgumentError, match="--random-range-ratio"):
        sample_requests("random", DatasetArgs(num_prompts=2, seed=0, random_range_ratio=1.0), vocab)
    with pytest.raises(InvalidArgumentError, match="--dataset-name"):
        sample_requests("sharegpt", DatasetArgs(num_prompts=2, seed=0), vocab)


# ---- metric math ------------------------------------------------------------------------------


def records():
    """A: ttft 100 ms, 5 tokens in 500 ms (tpot 100 ms); B: ttft 300 ms, 11 tokens in 2.3 s
    (tpot 200 ms); C: one token at 50 ms (no tpot); D: failed."""
    a = sm.RequestOutput(10, True, "", 5, 0.1, [0.1] * 4, 0.5, "a")
    b = sm.RequestOutput(20, True, "", 11, 0.3, [0.2] * 10, 2.3, "b")
    c = sm.RequestOutput(30, True, "", 1, 0.05, [], 0.05, "c")
    d = sm.RequestOutput(40, False, "HTTP 500: boom")
    return [a, b, c, d]


def test_metrics_hand_checked():
    outs = records()
    lens = sm.output_lens(outs, count_tokens=len)
    assert lens == [5, 11, 1, 0]
    m = sm.calculate_metrics(outs, lens, duration=2.0, percentiles=[50, 99, 99.9], goodput={})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 17)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(8.5)
    assert m["total_token_throughput"] == pytest.approx(38.5)
    assert "request_goodput" not in m
    assert m["mean_tpot_ms"] == pytest.approx(150)
    assert m["p99_tpot_ms"] == pytest.approx(199)  # 100 + 0.99 * (200 - 100)
    assert m["mean_ttft_ms"] == pytest.approx(150)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["p99_ttft_ms"] == pytest.approx(296)  # sorted 50, 100, 300: rank 1.98
    assert m["p50_itl_ms"] == pytest.approx(200)  # 4 gaps of 100, 10 of 200
    assert m["mean_itl_ms"] == pytest.approx((400 + 2000) / 14)
    assert m["mean_e2el_ms"] == pytest.approx((500 + 2300 + 50) / 3)
    assert m["std_e2el_ms"] > 0
    assert "p99.9_ttft_ms" in m and "p50_e2el_ms" in m


def test_goodput_counts_requests_meeting_all_slos():
    outs = records()
    lens = sm.output_lens(outs, count_tokens=len)

    def goodput(slos):
        return sm.calculate_metrics(outs, lens, 2.0, [99], sm.parse_goodput(slos))["request_goodput"]

    assert goodput(["ttft:200", "tpot:150"]) == pytest.approx(1.0)  # A and C (C's tpot is 0)
    assert goodput(["ttft:200", "e2el:400"]) == pytest.approx(0.5)  # C only
    assert goodput(["tpot:200"]) == pytest.approx(1.5)  # SLOs are inclusive
    with pytest.raises(InvalidArgumentError, match="--goodput"):
        sm.parse_goodput(["itl:5"])
    with pytest.raises(InvalidArgumentError, match="--goodput"):
        sm.parse_goodput(["ttft=5"])


def test_percentile_names_and_selection():
    assert [sm.p_word(p) for p in (99, 99.0, 99.9, 50)] == ["99", "99", "99.9", "50"]
    outs = records()
    m = sm.calculate_metrics(outs, sm.output_lens(outs, len), 2.0, [99], {})
    kept = sm.select_metrics(m, ["ttft", "tpot", "itl"], [99])
    assert "mean_ttft_ms" in kept and "p99_itl_ms" in kept
    assert not any("e2el" in k for k in kept)
    table = sm.format_summary({**kept, "max_concurrency": None, "request_rate": "inf"}, ["ttft"], [99])
    assert table.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert "P99 TTFT (ms):" in table and "TPOT" not in table


def test_output_tokens_counted_from_text_without_usage(vocab):
    o = sm.RequestOutput(3, True, "", None, 0.1, [0.1, 0.1], 0.3, CHUNK_TEXT * 3)
    assert sm.output_lens([o], vocab.count) == [3]


# ---- end to end against an SSE test double ----------------------------------------------------


class SSEServer:
    """Streams max_tokens chunks of CHUNK_TEXT per request; counts requests open at once."""

    def __init__(self, with_usage: bool = True):
        self.with_usage = with_usage
        self.bodies: list[dict] = []
        self.open = self.max_open = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["model"] == "broken":
            return web.json_response({"error": "no such model"}, status=404)
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        for _ in range(body["max_tokens"]):
            choice = {"delta": {"content": CHUNK_TEXT}} if chat else {"text": CHUNK_TEXT}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(0.002)
        self.open -= 1  # before the client can see the end of its stream
        if self.with_usage and body["stream_options"]["include_usage"]:
            usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"]}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def bench_args(url: str, *extra: str):
    return serve.build_parser().parse_args(
        ["--base-url", url, "--model", "tiny", "--num-prompts", "6", "--disable-tqdm"]
        + ["--random-input-len", "16", "--random-output-len", "6", "--random-range-ratio", "0.5", *extra]
    )


def test_run_benchmark_end_to_end_with_max_concurrency(vocab):
    with SSEServer() as server:
        args = bench_args(server.url, "--max-concurrency", "2", "--ignore-eos", "--goodput", "ttft:5000")
        result = asyncio.run(serve.run_benchmark(args, vocab=vocab))
    expected = [b["max_tokens"] for b in server.bodies]
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == sum(expected) == sum(result["output_lens"])
    assert sorted(result["output_lens"]) == sorted(expected)
    assert all(3 <= n <= 9 for n in expected)
    assert server.max_open == 2
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["model"] == "tiny"
    assert body["prompt"] and "messages" not in body
    for key in (
        "date backend model_id tokenizer_id num_prompts request_rate burstiness max_concurrency "
        "duration completed failed total_input_tokens total_output_tokens request_throughput "
        "request_goodput output_throughput total_token_throughput input_lens output_lens ttfts "
        "itls generated_texts errors mean_ttft_ms median_ttft_ms std_ttft_ms p99_ttft_ms "
        "mean_tpot_ms p99_tpot_ms mean_itl_ms median_itl_ms std_itl_ms p99_itl_ms"
    ).split():
        assert key in result, key
    assert "mean_e2el_ms" not in result  # not in the default --percentile-metrics
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 2
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert [len(gaps) for gaps in result["itls"]] == [n - 1 for n in result["output_lens"]]
    assert result["generated_texts"][0] == CHUNK_TEXT * result["output_lens"][0]
    assert result["errors"] == [""] * 6
    json.dumps(result)  # what --save-result writes


def test_chat_endpoint_counts_tokens_without_usage(vocab):
    with SSEServer(with_usage=False) as server:
        args = bench_args(server.url, "--endpoint", "/v1/chat/completions", "--request-rate", "200")
        result = asyncio.run(serve.run_benchmark(args, vocab=vocab))
    assert server.bodies[0]["messages"][0]["role"] == "user"
    assert result["backend"] == "openai-chat" and result["request_rate"] == 200.0
    assert result["total_output_tokens"] == sum(b["max_tokens"] for b in server.bodies)


def test_failed_requests_are_recorded(vocab):
    with SSEServer() as server:
        args = serve.build_parser().parse_args(
            ["--base-url", server.url, "--model", "broken", "--num-prompts", "3", "--disable-tqdm"]
            + ["--random-input-len", "8", "--random-output-len", "4"]
        )
        result = asyncio.run(serve.run_benchmark(args, vocab=vocab))
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (0, 3, 0)
    assert all(e.startswith("HTTP 404") for e in result["errors"])


def test_main_sweep_saves_one_json_per_rate(smollm2_path, tmp_path, capsys):
    with SSEServer() as server:
        rc = serve.main(
            ["--base-url", server.url, "--model", "org/tiny", "--tokenizer", str(smollm2_path)]
            + ["--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3"]
            + ["--request-rate", "inf,100", "--metric-percentiles", "50,99.9", "--disable-tqdm"]
            + ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json"]
        )
    assert rc == 0
    assert "============ Serving Benchmark Result ============" in capsys.readouterr().out
    inf, hundred = (json.loads((tmp_path / f"run-{r}qps.json").read_text()) for r in ("inf", "100.0"))
    assert inf["request_rate"] == "inf" and hundred["request_rate"] == 100.0
    assert hundred["completed"] == 4 and "p99.9_itl_ms" in hundred and "p50_ttft_ms" in hundred


def test_flag_errors_are_named():
    args = bench_args("http://127.0.0.1:9", "--percentile-metrics", "ttft,latency")
    with pytest.raises(InvalidArgumentError, match="--percentile-metrics"):
        asyncio.run(serve.run_benchmark(args))
    assert serve.main(["--model", "m", "--request-rate", "0"]) == 2


def test_plot_needs_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    import serve_plot

    with pytest.raises(KvrayError, match="pip install matplotlib"):
        serve_plot.require_matplotlib()


def test_kvray_bench_serve_dispatch(monkeypatch, capsys):
    from kvray.cluster import cli

    args = cli.build_parser().parse_args(["bench", "serve", "--model", "m", "--num-prompts", "3"])
    assert (args.name, args.rest) == ("serve", ["--model", "m", "--num-prompts", "3"])
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "serve", "--help"])
    assert exit_.value.code == 0
    assert "--random-prefix-len" in capsys.readouterr().out


def test_plots_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    import serve_plot

    outs = records()
    lens = sm.output_lens(outs, len)
    runs = []
    for rate in (2.0, "inf"):
        m = sm.calculate_metrics(outs, lens, 2.0, [99], {})
        runs.append(
            {**m, "model_id": "m", "request_rate": rate, "max_concurrency": None}
            | {"ttfts": [o.ttft for o in outs], "itls": [o.itl for o in outs]}
            | {"e2els": [o.e2el for o in outs], "errors": [o.error for o in outs]}
        )
    paths = [serve_plot.plot_run(r, tmp_path) for r in runs] + [serve_plot.plot_sweep(runs, tmp_path)]
    assert [p.name for p in paths] == ["2.0qps-cdf.png", "infqps-cdf.png", "sweep.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
