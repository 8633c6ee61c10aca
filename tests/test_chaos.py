"""Chaos: the PD app under streaming load while a decode worker, the prefill worker and
every Router replica are killed at spaced times. No request may fail: streams in flight
move to the other decode worker, requests that find no prefill worker wait for Serve's
replacement, the Routers are replaced and find the pools again. Afterwards every output
equals the offline engine's, no block is used or pinned anywhere, and every pool is back
to its size.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvray.engine import LLM, SamplingParams

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPTS = [f"Story {i}: once upon a time, in a town by the sea," for i in range(8)]
MAX_TOKENS = 32


def _kill(part: str, limit: int = 100) -> list[str]:
    """Kill (at most `limit` of) the named actors whose name contains `part`."""
    killed = []
    actors = sorted(ray.util.list_named_actors(all_namespaces=True), key=lambda a: a["name"])
    for actor in actors:
        if part in actor["name"] and len(killed) < limit:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            killed.append(actor["name"])
    return killed


def _client(ingress, prompts: list[str], results: dict, errors: list) -> None:
    for prompt in prompts:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        try:
            text = ""
            for chunk in ingress.options(stream=True).generate_stream.remote(body):
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                text += "".join(c["text"] for c in chunk["choices"])
            results[prompt] = text
        except Exception as e:  # noqa: BLE001 (any failure fails the test)
            errors.append(f"{prompt!r}: {e!r}")


def test_killing_workers_and_routers_under_load_loses_no_request(local_serve, engine_args):
    from kvray.router.app import build_app

    prompts = PROMPTS + [p + " Again," for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = {p: o.outputs[0].text for p, o in zip(prompts, LLM(**engine_args).generate(prompts, greedy))}
    pool = {"num_cpus": 0.3, "torch_threads": 1}
    config = {
        "engine": {**engine_args, "max_num_seqs": 16},
        "prefill": {**pool, "num_workers": 1},
        "decode": {**pool, "num_workers": 2},
        "router": {"health_check_seconds": 0.5, "num_replicas": 2},
    }
    ingress = serve.run(build_app(config), name="kvray", route_prefix="/")
    router = serve.get_deployment_handle("kvray-router", app_name="kvray")
    try:
        sizes = {role: len(ids) for role, ids in router.live_workers.remote().result(timeout_s=60).items()}
        assert sizes == {"prefill": 1, "decode": 2}
        results: dict[str, str] = {}
        errors: list[str] = []
        # 8 clients, each streaming its prompt twice over (the second run meets the chaos)
        clients = [
            threading.Thread(target=_client, args=(ingress, [p, p + " Again,"], results, errors))
            for p in PROMPTS
        ]
        for c in clients:
            c.start()
        time.sleep(8)
        assert len(_kill("kvray-decode-", limit=1)) == 1  # one of the two decode workers
        time.sleep(10)
        assert len(_kill("kvray-prefill-")) == 1  # the only prefill worker
        time.sleep(10)
        assert len(_kill("kvray-router")) == 2  # every Router replica
        for c in clients:
            c.join(timeout=600)
        assert not errors, errors
        assert results == want
        deadline = time.monotonic() + 180
        while True:  # Serve replaces the dead; the Routers find them
            try:
                live = router.live_workers.remote().result(timeout_s=10)
                stats = router.worker_stats.remote().result(timeout_s=10)
                if {r: len(ids) for r, ids in live.items()} == sizes and all(
                    s.used_blocks == 0 and s.pinned == 0 for s in stats
                ):
                    break
            except Exception:  # a Router replica is starting
                pass
            assert time.monotonic() < deadline, "pools did not come back clean"
            time.sleep(1)
    finally:
        serve.delete("kvray")
