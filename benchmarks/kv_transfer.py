"""KV transfer: pull throughput per connector against a raw torch.distributed send, and
TTFT / inter-token latency of the disaggregated path against colocated, in one run.

Part 1 runs two Ray actors holding paged caches of a given layout (random contents):
one pins n blocks as a prefill worker does, the other pulls them through the real
connector (request, header, pack, send, unpack into its own blocks), then the same bytes
go as raw `send`s over the same pair group between the same two actors, each timed from
the sender's start to the receiver's completion (no Ray call inside the raw timing).

Part 2 serves SmolLM2 (fp32) on this machine both ways with the same CPU budget: one
prefill + one decode worker (1 torch thread each) against one mixed worker (2 threads).

    python benchmarks/kv_transfer.py [--skip-latency] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import ray
import torch

from kvray.actors.kv_socket import socket_address
from kvray.actors.kv_transport import CONNECTOR_NAMES, KVSource, connector_class
from kvray.actors.net import bind_collectives_to, node_ip
from kvray.cluster.local import ensure_ray, launch
from kvray.configs import KVTransferConfig
from kvray.engine import SamplingParams
from kvray.engine.kv_handoff import PinTable
from kvray.engine.kv_transfer import KVLayout, KVTicket
from kvray.engine.kv_views import KVViews

LAYOUTS = {
    "SmolLM2-135M (fp32)": KVLayout(30, 16, 3, 64, "float32"),
    "Llama-3-8B (bf16)": KVLayout(32, 16, 8, 128, "bfloat16"),
}
BLOCK_COUNTS = (1, 16, 256)


@ray.remote(num_cpus=0.5)
class KVPeer:
    """A paged cache and the connector endpoints of a worker, without a model."""

    def __init__(self, peer_id: str, layout: KVLayout, num_blocks: int):
        torch.set_num_threads(1)
        self.cache = torch.randn(layout.packed_shape(num_blocks)).to(layout.torch_dtype)  # as an engine's
        self.pins = PinTable()
        self.views = KVViews(self.cache, self.pins)  # what an engine hands its worker
        self.source = KVSource(self.views, layout)
        config = KVTransferConfig(pull_timeout_seconds=120)
        host = node_ip()
        bind_collectives_to(host)  # as a worker does: gloo on the interface of the node's IP
        self.connectors = {n: connector_class(n)(peer_id, config, host, "gloo") for n in CONNECTOR_NAMES}
        self.layout = layout

    def pin(self, request_id: str, blocks: list[int]) -> KVTicket:
        n = len(blocks) * self.layout.block_size
        self.pins.add(request_id, blocks, time.time() + 3600, n, ())
        return KVTicket("src", request_id, tuple(blocks), n, (), self.layout, time.time() + 3600)

    async def export_kv(self, request_id):
        return await self.source.export_kv(request_id)

    async def join_pair(self, peer_id, host, port, key, backend):
        await self.source.join_pair(peer_id, host, port, key, backend, 120)

    async def kv_socket_address(self):
        return socket_address(self.source, node_ip(), 120)

    async def pull(
        self, connector: str, ticket: KVTicket, src, dst_blocks: list[int], reps: int
    ) -> list[float]:
        puller = self.connectors[connector]
        into = self.views.of(dst_blocks)
        await puller.pull(ticket, src, into)  # warm-up (and the pair group)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            await puller.pull(ticket, src, into)
            times.append(time.perf_counter() - t)
        packed = await src.export_kv.remote(ticket.request_id)
        assert torch.equal(self.cache[0, 0, dst_blocks[0]], packed[0, 0, 0])
        return times

    # raw sends of the same bytes, back to back over the same pair (no Ray call in between)
    async def raw_recv(self, peer_id: str, nbytes: int, count: int, tag: int) -> list[float]:
        """Completion time of each of `count` receives, posted one after another."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        pg = self.connectors["torch_dist"].groups[peer_id].data

        def loop() -> list[float]:
            done = []
            for i in range(count):
                pg.recv([buf], 1, tag + i).wait()
                done.append(time.perf_counter())
            return done

        return await asyncio.to_thread(loop)

    async def raw_send(self, peer_id: str, nbytes: int, count: int, tag: int) -> list[float]:
        """Start time of each of `count` sends, each started when the previous one is done."""
        buf = torch.ones(nbytes, dtype=torch.uint8)
        pg = self.source.pair_groups[peer_id].data

        def loop() -> list[float]:
            starts = []
            for i in range(count):
                starts.append(time.perf_counter())
                pg.send([buf], 0, tag + i).wait()
            return starts

        return await asyncio.to_thread(loop)


def transfer_table(reps: int) -> list[str]:
    rows = [
        "| layout | blocks | MB | connector | pull GB/s | raw send GB/s | pull / raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, layout in LAYOUTS.items():
        src = KVPeer.remote("src", layout, 2 * max(BLOCK_COUNTS) + 8)
        dst = KVPeer.remote("dst", layout, max(BLOCK_COUNTS) + 8)
        for n in BLOCK_COUNTS:
            ticket = ray.get(src.pin.remote(f"r{n}", list(range(1, 2 * n, 2))))  # non-contiguous blocks
            nbytes = layout.packed_bytes(n)
            pulls = {
                c: statistics.median(ray.get(dst.pull.remote(c, ticket, src, list(range(n)), reps)))
                for c in CONNECTOR_NAMES
            }
            raw = _raw_send_seconds(src, dst, nbytes, reps)
            for connector, seconds in pulls.items():
                rows.append(
                    f"| {name} | {n} | {nbytes / 1e6:.1f} | {connector} | {nbytes / seconds / 1e9:.2f} | "
                    f"{nbytes / raw / 1e9:.2f} | {100 * raw / seconds:.0f} % |"
                )
        ray.kill(src)
        ray.kill(dst)
    return rows


def _raw_send_seconds(src, dst, nbytes: int, reps: int) -> float:
    """Median time of one raw send of nbytes: from the sender's start to the receiver's
    completion (both actors share this machine's monotonic clock), after a warm-up send."""
    recv = dst.raw_recv.remote("src", nbytes, reps + 1, 1 << 30)
    starts = ray.get(src.raw_send.remote("dst", nbytes, reps + 1, 1 << 30))
    done = ray.get(recv)
    return statistics.median(d - s for s, d in list(zip(starts, done))[1:])


def latency_table(num_requests: int, pd: dict | None = None, mixed: dict | None = None) -> list[str]:
    """`pd` ({"prefill": resources, "decode": resources}) and `mixed` (resources): custom
    Ray resources that place the workers (benchmarks/kv_transfer_nodes.py: on given nodes)."""
    pd = pd or {}
    from transformers import AutoTokenizer

    from kvray.models.loader import resolve_model_path

    path = str(resolve_model_path("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)).split()
    prompts = [
        {"prompt_token_ids": tok(" ".join(words[i * 300 : i * 300 + 60 + 40 * i])).input_ids}
        for i in range(num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine = {"model": path, "dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20}
    rows = [
        "| mode | TTFT p50 (s) | TTFT p90 (s) | ITL p50 (ms) | ITL p90 (ms) | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, deployment in (
        (
            "disaggregated 1P+1D, tcp",
            {
                "disaggregated": True,
                "kv_transfer": {"connector": "tcp"},  # as the CPU presets
                "prefill": {"num_cpus": 1, "torch_threads": 1, "resources": pd.get("prefill", {})},
                "decode": {"num_cpus": 1, "torch_threads": 1, "resources": pd.get("decode", {})},
            },
        ),
        (
            "colocated, 1 mixed worker",
            {"disaggregated": False, "mixed": {"num_cpus": 2, "torch_threads": 2, "resources": mixed or {}}},
        ),
    ):
        cluster = launch({"engine": engine, **deployment})
        try:
            _ = cluster.complete(prompts[0], params)  # warm-up (and the pair group)
            ttft, itl, wall = _measure(cluster, prompts, params)
        finally:
            cluster.shutdown()
        rows.append(
            f"| {mode} | {_pct(ttft, 50):.2f} | {_pct(ttft, 90):.2f} | {1e3 * _pct(itl, 50):.0f} | "
            f"{1e3 * _pct(itl, 90):.0f} | {wall:.1f} |"
        )
    return rows


def _measure(cluster, prompts, params):
    """Every stream read on its own thread, so each output is timed when it arrives."""
    import threading

    ttft, itl = [], []

    def consume(prompt) -> None:
        sent = time.perf_counter()
        first = last = None
        tokens = 0
        for ref in cluster.front.generate.remote(prompt, params):
            out = ray.get(ref)
            now = time.perf_counter()
            if first is None:
                first = now
                ttft.append(now - sent)
            last, tokens = now, len(out.outputs[0].token_ids)
        if tokens > 1:
            itl.append((last - first) / (tokens - 1))

    start = time.perf_counter()
    threads = [threading.Thread(target=consume, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttft, itl, time.perf_counter() - start


def _pct(values: list[float], p: int) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-transfer", action="store_true")
    args = parser.parse_args()
    started = ensure_ray(num_cpus=2)
    try:
        if not args.skip_transfer:
            print("\n".join(transfer_table(args.reps)))
        if not args.skip_latency:
            print()
            print("\n".join(latency_table(args.num_requests)))
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    main()
