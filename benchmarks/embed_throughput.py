"""Embedding throughput (issue 53, item 3): `LLM.embed` on the `all-minilm-l6-v2` alias
against transformers' BertModel run the way sentence-transformers runs it (inputs sorted by
length, batches of `--batch-size`, mean pooling, unit length), same texts, same threads,
one run. Texts: `--num-texts` of English words, lengths drawn from 8 to 250 tokens. With
`--served`, also through `kvray serve` (the colocated CPU preset, its embedding worker given
`--threads`): `--clients` concurrent clients each posting one text a request to
/v1/embeddings, which the worker batches as they arrive.

    python benchmarks/embed_throughput.py [--num-texts 512] [--batch-size 32] [--threads 2]
        [--served] [--clients 16]
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from serve_harness import Server, cpu_banner, preset_file

WORDS = "river stone light quiet market paper seven garden winter answer bridge silver music".split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 248))) for _ in range(n)]


def transformers_embed(model, tokenizer, inputs: list[str], batch_size: int) -> torch.Tensor:
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out = torch.empty(len(inputs), model.config.hidden_size)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        enc = tokenizer(
            [inputs[i] for i in index], padding=True, truncation=True, max_length=256, return_tensors="pt"
        )
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"][:, :, None].float()
        out[index] = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    return out


def served(inputs: list[str], threads: int, clients: int) -> float:
    """Seconds for `clients` concurrent clients to embed `inputs`, one text a request,
    through `kvray serve` (the colocated preset; its embedding worker on `threads`)."""
    import json
    import urllib.request

    def widen(config: dict) -> None:
        config["embedding"]["torch_threads"] = threads
        config["max_queued_requests"] = max(64, clients)

    path = preset_file("smollm2-cpu", widen, "embed")
    with Server(path, log="/tmp/kvray-embed-bench.log") as server:

        def one(text: str) -> None:
            body = json.dumps({"model": "all-minilm-l6-v2", "input": text}).encode()
            headers = {"Content-Type": "application/json"}
            request = urllib.request.Request(f"{server.url}/v1/embeddings", body, headers)
            with urllib.request.urlopen(request, timeout=120) as r:
                r.read()

        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, inputs[:clients]))  # warm
            start = time.perf_counter()
            list(pool.map(one, inputs))
            return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--served", action="store_true", help="also through kvray serve's /v1/embeddings")
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModel, AutoTokenizer

    from kvray.engine import LLM
    from kvray.models.loader import resolve_model_path

    inputs = texts(args.num_texts, args.seed)
    llm = LLM(model="all-minilm-l6-v2")
    path = resolve_model_path("all-minilm-l6-v2")
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    tokens = sum(len(ids) for ids in llm.embedder.token_ids(inputs))
    llm.embed(inputs[:16])  # warm
    transformers_embed(model, tokenizer, inputs[:16], args.batch_size)

    start = time.perf_counter()
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(inputs)])
    kvray_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = transformers_embed(model, tokenizer, inputs, args.batch_size)
    hf_s = time.perf_counter() - start
    cosine = torch.nn.functional.cosine_similarity(ours, theirs).min().item()
    served_s = served(inputs, args.threads, args.clients) if args.served else None

    print(cpu_banner())
    print(f"{args.num_texts} texts, {tokens} tokens (8-250 a text), {args.threads} threads, fp32\n")
    print("| engine | seconds | texts/s | tokens/s | vs transformers |")
    print("|---|---|---|---|---|")
    print(f"| transformers BertModel, sorted batches of {args.batch_size} | {hf_s:.2f} | "
          f"{args.num_texts / hf_s:.1f} | {tokens / hf_s:.0f} | 1.00x |")  # fmt: skip
    print(f"| kvray `LLM.embed` | {kvray_s:.2f} | {args.num_texts / kvray_s:.1f} | {tokens / kvray_s:.0f} | "
          f"{hf_s / kvray_s:.2f}x |")  # fmt: skip
    if served_s is not None:
        print(f"| kvray serve /v1/embeddings, {args.clients} clients, one text a request | "
              f"{served_s:.2f} | {args.num_texts / served_s:.1f} | {tokens / served_s:.0f} | "
              f"{hf_s / served_s:.2f}x |")  # fmt: skip
    print(f"\nlowest cosine between the two: {cosine:.6f}")


if __name__ == "__main__":
    main()
