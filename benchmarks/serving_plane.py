"""Serving-plane capacity: how many tokens per second `kvray serve` delivers to clients
when computing them is nearly free, and what the plane (Serve proxy, ingress replicas,
Router replicas) spends per token, with 1 and 2 ingress replicas, in one run beside the
same load against another kvray tree (`--baseline-src`, e.g. the previous commit).

The model is a tiny random-weight Llama (2 layers, hidden 64) with SmolLM2's vocabulary
and tokenizer, written to a temp folder; one colocated worker with a wide batch. Load:
`--num-prompts` streamed requests of 16 prompt tokens and `--output-len` generated tokens
(ignore_eos), `--max-concurrency` at once.

    python benchmarks/serving_plane.py [--baseline-src DIR] [--replicas 1,2] [--http direct,proxy]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import yaml
from serve_harness import Server, cpu_banner, run_load

PLANE = ("ProxyActor", "-ingress", "-router")  # process titles of the plane's actors (a
# direct-ingress app has no proxy: its ingress replicas serve HTTP themselves)


def tiny_model(folder: Path) -> Path:
    """A 2-layer Llama with SmolLM2's vocabulary and tokenizer, random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvray.models.loader import resolve_model_path

    smollm2 = resolve_model_path("smollm2-135m-instruct")
    vocab = LlamaConfig.from_pretrained(smollm2).vocab_size
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for f in smollm2.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.suffix == ".jinja":
            shutil.copy(f, folder / f.name)
    return folder


def plane_cpu_seconds(session: int) -> float:
    """CPU seconds used so far by the plane's processes of one `kvray serve` (its session)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) != session or not any(p in title for p in PLANE):
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def config_file(model: Path, replicas: int, new_code: bool, direct: bool = True) -> str:
    config = {
        "model_name": "tiny",
        "engine": {"model": str(model), "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 256},
        "disaggregated": False,
        "mixed": {"num_workers": 1, "num_cpus": 1.0, "torch_threads": 1},
        "num_replicas": replicas,
        "max_queued_requests": 512,
    }
    if new_code:  # as the CPU presets: two Routers (and HTTP from the ingress replicas themselves)
        config["router"] = {"num_replicas": 2}
        config["direct_ingress"] = direct
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kvray-plane-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline-src", default=None)
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--http", default="direct,proxy", help="this tree's HTTP paths to run")
    parser.add_argument("--num-prompts", type=int, default=384)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-concurrency", type=int, default=192)
    args = parser.parse_args()
    model = tiny_model(Path(tempfile.mkdtemp(prefix="kvray-tiny-")))
    load = [
        "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", "16",
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--disable-tqdm",
    ]  # fmt: skip
    warm = [*load[:4], "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "8"]
    rows = []
    runs = [(f"kvray, {http}", None, http == "direct") for http in args.http.split(",")]
    runs += [("baseline", args.baseline_src, False)] if args.baseline_src else []
    for label, src, direct in runs:
        for replicas in map(int, args.replicas.split(",")):
            config = config_file(model, replicas, new_code=src is None, direct=direct)
            with Server(
                config, src, log=f"/tmp/kvray-plane-{label.replace(', ', '-')}-{replicas}.log"
            ) as server:
                run_load(server.url, "tiny", [*warm, "--ignore-eos", "--disable-tqdm"])
                cpu = plane_cpu_seconds(server.proc.pid)
                r = run_load(server.url, "tiny", load)
                cpu = plane_cpu_seconds(server.proc.pid) - cpu
            tokens = r["total_output_tokens"]
            rows.append((label, replicas, r["output_throughput"], cpu / max(tokens, 1) * 1e6, r))
            print(f"{label} ingress x{replicas}: {r['output_throughput']:.0f} tok/s, "
                  f"{rows[-1][3]:.0f} plane CPU-us/token, {r['completed']} done", flush=True)  # fmt: skip
    print(f"\n{cpu_banner()}")
    print(f"load: {args.num_prompts} streamed requests x {args.output_len} tokens, "
          f"{args.max_concurrency} concurrent; tiny random Llama, 1 colocated worker\n")  # fmt: skip
    print("| code | ingress replicas | tokens/s to clients | plane CPU µs / token | completed |")
    print("|---|---|---|---|---|")
    for label, replicas, tput, cpu_us, r in rows:
        print(f"| {label} | {replicas} | {tput:.0f} | {cpu_us:.0f} | {r['completed']}/{r['num_prompts']} |")


if __name__ == "__main__":
    main()
