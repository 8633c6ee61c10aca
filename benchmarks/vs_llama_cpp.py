"""kvray against llama.cpp on llama.cpp's own GGUF files (issue 51, item 6), one machine,
the same threads, side by side in one run:

- prompt processing: a 512-token prompt (llama-bench `pp512`; kvray: the prompt and its
  first token, prefix caching off);
- single-stream decode: 128 tokens (llama-bench `tg128`; kvray: a 129-token generation
  less the 1-token one, from a 4-token prompt);
- the memory the weights add to kvray's process (its resident anonymous memory after
  loading less before, less the KV cache's bytes, which loading touches; the file's size
  beside it).

kvray runs each `--quantization` (default: gguf, the file's own codes; none: the
de-quantized weights in the dtype, quantization_ignore=["*"]; int4:128: int4 in groups of
128) in a child process of its own; without `--llama-bin`, kvray's rows alone. llama.cpp's
tools build from the source vendored in the `llama-cpp-python` sdist (BENCHMARKS.md says how):

    .venv/bin/python benchmarks/vs_llama_cpp.py --llama-bin /path/to/llama.cpp/build/bin \
        [--models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct] [--quantization gguf,none,int4:128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from serve_harness import cpu_banner


def rss_bytes() -> int:
    """This process's resident anonymous memory (not the shared libraries' code pages a first
    use brings in)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def kvray_child(
    alias: str, quantization: str | None, prompt: int, new: int, reps: int, group: int = 32
) -> dict:
    """In this process: load, then time the prompt and the decode (best of `reps`)."""
    import torch

    from kvray.engine import LLM, SamplingParams
    from kvray.kernels.cpu_memory import release_freed_memory
    from kvray.models.loader import load_config, load_tokenizer, resolve_model_path

    torch.set_num_threads(2)
    path = resolve_model_path(alias)
    load_config(path), load_tokenizer(path)  # what a process holds besides the weights, loaded first
    before = rss_bytes()
    kv = 96 << 20  # a small KV cache (the prompt and the decode fit), its bytes not counted
    dense = {"quantization_ignore": ["*"]} if quantization is None else {}  # the file's values in dtype
    llm = LLM(model=alias, dtype="auto", quantization=quantization, quantization_group_size=group,
              max_model_len=2048, enable_prefix_caching=False, kv_cache_memory_bytes=kv, **dense)  # fmt: skip
    release_freed_memory()
    after = rss_bytes() - kv
    vocab = llm.engine.hf_config.vocab_size
    long = {"prompt_token_ids": [(7 * i + 11) % (vocab - 300) + 100 for i in range(prompt)]}
    short = {"prompt_token_ids": [(13 * i + 5) % (vocab - 300) + 100 for i in range(4)]}

    def timed(request, tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([request], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start

    timed(short, 8)  # warm
    pp = min(timed(long, 1) for _ in range(reps))
    tg = min(timed(short, new + 1) - timed(short, 1) for _ in range(reps))
    return {"pp": prompt / pp, "tg": new / tg, "weights_rss": after - before, "dtype": str(llm.engine.dtype)}


def kvray(alias: str, mode: str, args) -> dict:
    """`mode`: a --quantization entry (none, gguf, int8, int4, int4:128)"""
    quantization, _, group = mode.partition(":")
    quantization = None if quantization == "none" else quantization
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import vs_llama_cpp as b; "
        f"result = b.kvray_child({alias!r}, {quantization!r}, {args.prompt}, {args.new}, {args.reps}, "
        f"{int(group or 32)}); "
        "print('RESULT', json.dumps(result))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[7:])


def llama_bench(gguf: Path, args) -> dict:
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-p",
           str(args.prompt), "-n", str(args.new), "-r", str(args.reps), "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    pp = next(r for r in rows if r["n_prompt"] == args.prompt and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] == args.new and r["n_prompt"] == 0)
    return {
        "pp": pp["avg_ts"],
        "tg": tg["avg_ts"],
        "build": pp.get("build_commit", "?"),
        "type": pp.get("model_type"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-bin", default=None, help="the folder holding llama-bench")
    parser.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--quantization", default="gguf,none", help="kvray's, comma-separated (none: None)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    from kvray.models.fetch import GGUF_NAME, fetch_alias

    print(cpu_banner())
    print(
        f"threads {args.threads}, pp{args.prompt}, tg{args.new}, "
        f"best of {args.reps} (kvray), mean (llama-bench)\n"
    )

    def row(*cells: str) -> None:
        print("| " + " | ".join(cells) + " |")

    row("model", "file", "engine", "pp tok/s", "tg tok/s", "tg vs llama.cpp", "weights RSS / file")
    row(*["---"] * 7)
    for alias in args.models.split(","):
        gguf = fetch_alias(alias) / GGUF_NAME
        size = gguf.stat().st_size
        ref = llama_bench(gguf, args) if args.llama_bin else None
        if ref is not None:
            engine = f"llama.cpp {ref['build']} ({ref['type']})"
            row(alias, f"{size / 1e6:.0f} MB", engine, f"{ref['pp']:.1f}", f"{ref['tg']:.1f}", "1.00x", "")
        for q in args.quantization.split(","):
            got = kvray(alias, q, args)
            engine = f"kvray {q} ({got['dtype'].removeprefix('torch.')})"
            ratio = f"{got['tg'] / ref['tg']:.2f}x" if ref is not None else "-"
            file, held = (
                "" if ref is not None else f"{size / 1e6:.0f} MB",
                f"{got['weights_rss'] / size:.2f}x",
            )
            row(alias, file, engine, f"{got['pp']:.1f}", f"{got['tg']:.1f}", ratio, held)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
