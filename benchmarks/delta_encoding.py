"""How a step's batch of deltas is best encoded for the worker -> front stream: pickle
(what Ray does with a list of `Delta` tuples today), msgpack and msgspec (if installed)
of the same values as plain arrays. Bytes per batch and µs to encode + decode, beside
the measured cost of one item on a Ray actor stream (about 700 µs on a 2-core machine),
which is what the choice would have to beat.

    python benchmarks/delta_encoding.py [--batch 1,16,128] [--logprobs 0,5]
"""

from __future__ import annotations

import argparse
import pickle
import time

from serve_harness import cpu_banner

from kvray.actors.messages import Delta
from kvray.engine.outputs import Logprob


def batch(n: int, top: int) -> list[Delta]:
    """`n` requests' deltas of one decode step: one token, a short piece of text."""
    out = []
    for i in range(n):
        lps = [{17 + k: Logprob(-0.1 * (k + 1), k + 1, f" tok{k}") for k in range(top)}] if top else None
        out.append(Delta(f"cmpl-{i:08x}-0", [1234 + i], " word", lps, None, None, None))
    return out


def plain(deltas: list[Delta]) -> list:
    """The same values as nested arrays (what msgpack/msgspec can carry without hooks)."""
    return [
        [
            d.request_id,
            d.token_ids,
            d.text,
            [[[t, e.logprob, e.rank, e.decoded_token] for t, e in lp.items()] for lp in d.logprobs]
            if d.logprobs
            else None,
            d.finish_reason,
            d.stop_reason,
        ]
        for d in deltas
    ]


def codecs() -> dict:
    found = {"pickle (Ray today)": (lambda b: pickle.dumps(b, protocol=5), pickle.loads, False)}
    try:
        import msgpack

        found["msgpack (plain arrays)"] = (msgpack.packb, msgpack.unpackb, True)
    except ImportError:
        pass
    try:
        import msgspec

        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        found["msgspec (plain arrays)"] = (enc.encode, dec.decode, True)
    except ImportError:
        pass
    return found


def timed(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16,128")
    ap.add_argument("--logprobs", default="0,5")
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    print(cpu_banner())
    print("| deltas per batch | top logprobs | codec | bytes | encode+decode µs | to plain arrays µs |")
    print("|---|---|---|---|---|---|")
    for n in map(int, args.batch.split(",")):
        for top in map(int, args.logprobs.split(",")):
            for line in rows(batch(n, top), args.reps):
                print(f"| {n} | {top} | " + line)


def rows(deltas: list[Delta], reps: int) -> list[str]:
    convert = timed(lambda: plain(deltas), reps)
    out = []
    for name, (enc, dec, needs_plain) in codecs().items():
        if needs_plain:
            data = enc(plain(deltas))
            us = timed(lambda enc=enc, dec=dec: dec(enc(plain(deltas))), reps)
        else:
            data = enc(deltas)
            us = timed(lambda enc=enc, dec=dec: dec(enc(deltas)), reps)
        extra = f"{convert:.1f}" if needs_plain else "—"
        out.append(f"{name} | {len(data)} | {us:.1f} | {extra} |")
    return out


if __name__ == "__main__":
    main()
