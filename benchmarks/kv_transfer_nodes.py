"""KV transfer across a real link: three Ray nodes in network namespaces (cluster/netns.py),
each link shaped to a rate; pulls from a node to another against a plain TCP stream of the
same bytes over the same link, and TTFT of PD against colocated, at each rate.

Node 0 is the head (the driver), node 1 offers `kvray_prefill`, node 2 `kvray_decode`.
Part 1: two `KVPeer` actors of benchmarks/kv_transfer.py, one per node, pull n pinned
blocks through the real `torch_dist` and `tcp` connectors; the baseline sends the same number of
bytes over a TCP connection between the same two namespaces (sender to receiver, the
receiver's one-byte answer ends the timing, as the pull's last chunk ends it), in the
same run. Part 2 serves SmolLM2 (fp32) with the prefill worker on node 1 and the decode
worker on node 2, against one mixed worker on node 2.

    sudo python benchmarks/kv_transfer_nodes.py [--rates 1gbit 10gbit] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import uuid

from kvray.cluster.netns import NamespaceCluster

PREFILL, DECODE = 1, 2
SIZES_BLOCKS = (2, 16, 128)  # SmolLM2 fp32: 1.5, 11.8, 94 MB
TCP_PORT = 29870


def tcp_seconds(cluster: NamespaceCluster, nbytes: int, reps: int) -> float:
    """Median time to send `nbytes` from node 1 to node 2 over one warm TCP connection,
    until the receiver's one-byte answer is back."""
    ready = threading.Event()

    def serve() -> None:
        with socket.create_server((cluster.ip(DECODE), TCP_PORT)) as server:
            ready.set()
            conn, _ = server.accept()
            with conn:
                buf = bytearray(4 << 20)
                for _ in range(reps + 1):
                    left = nbytes
                    while left:
                        left -= conn.recv_into(buf, min(left, len(buf)))
                    conn.sendall(b"k")

    def send() -> list[float]:
        payload = bytes(nbytes)
        with socket.create_connection((cluster.ip(DECODE), TCP_PORT)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(reps + 1):
                start = time.perf_counter()
                conn.sendall(payload)
                conn.recv(1)
                times.append(time.perf_counter() - start)
        return times[1:]

    receiver = cluster.call(DECODE, serve)
    ready.wait(10)
    times = cluster.call(PREFILL, send).result(timeout=600)
    receiver.result(timeout=60)
    return statistics.median(times)


def driver(args: argparse.Namespace) -> None:
    """Inside the head's namespace: the pulls and the served latency (prints JSON)."""
    import ray

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kv_transfer import KVPeer, _raw_send_seconds, latency_table

    from kvray.engine.kv_transfer import KVLayout

    ray.init(address=args.address)
    layout = KVLayout(30, 16, 3, 64, "float32")
    src = KVPeer.options(resources={"kvray_prefill": 0.01}).remote("src", layout, 2 * max(SIZES_BLOCKS) + 8)
    dst = KVPeer.options(resources={"kvray_decode": 0.01}).remote("dst", layout, max(SIZES_BLOCKS) + 8)
    pulls = {}
    for n in SIZES_BLOCKS:
        ticket = ray.get(src.pin.remote(f"r{n}", list(range(1, 2 * n, 2))))
        times = {
            c: statistics.median(ray.get(dst.pull.remote(c, ticket, src, list(range(n)), args.reps)))
            for c in ("torch_dist", "tcp")
        }
        raw = _raw_send_seconds(src, dst, layout.packed_bytes(n), args.reps)  # one gloo send, same pair
        pulls[n] = (layout.packed_bytes(n), times["torch_dist"], times["tcp"], raw)
    ray.kill(src)
    ray.kill(dst)
    rows = []
    if not args.skip_latency:
        rows = latency_table(
            args.num_requests,
            pd={"prefill": {"kvray_prefill": 0.01}, "decode": {"kvray_decode": 0.01}},
            mixed={"kvray_decode": 0.01},
        )
    print("RESULT " + json.dumps({"pulls": pulls, "latency": rows}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        return driver(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from serve_harness import cpu_banner

    print(cpu_banner())
    for rate in args.rates:
        cluster = NamespaceCluster(
            f"kvb{uuid.uuid4().hex[:5]}",
            3,
            "10.215.0",
            [{}, {"kvray_prefill": 1}, {"kvray_decode": 1}],
            rate=rate,
        )
        try:
            cluster.up()
            me = [sys.executable, os.path.abspath(__file__), "--driver", "--address", cluster.head_address]
            me += ["--reps", str(args.reps), "--num-requests", str(args.num_requests)]
            me += ["--skip-latency"] if args.skip_latency else []
            out = cluster.run(0, me, timeout=1800).stdout
            result = json.loads(out.split("RESULT ", 1)[1])
            print(f"\nlink: {rate} each way (tbf), node 1 -> node 2\n")
            print(
                "| MB | torch_dist pull (MB/s) | tcp pull (MB/s) | one gloo send (MB/s) | TCP stream (MB/s) "
                "| torch_dist / TCP | tcp / TCP |"
            )
            print("|---|---|---|---|---|---|---|")
            pulls = sorted(result["pulls"].items(), key=lambda kv: int(kv[0]))
            for _, (nbytes, pull_s, tcp_s, gloo_s) in pulls:
                raw_s = tcp_seconds(cluster, nbytes, args.reps)
                mb_s = [nbytes / s / 1e6 for s in (pull_s, tcp_s, gloo_s, raw_s)]
                print("| " + " | ".join([f"{nbytes / 1e6:.1f}", *(f"{r:.0f}" for r in mb_s)]) + " | "
                      f"{100 * raw_s / pull_s:.0f} % | {100 * raw_s / tcp_s:.0f} % |")  # fmt: skip
            if result["latency"]:
                print()
                print("\n".join(result["latency"]))
        finally:
            cluster.down()


if __name__ == "__main__":
    main()
