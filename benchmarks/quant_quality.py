"""What kvray's quantized weights cost in quality (issue 51, item 5), on a fixed
public-domain text (benchmarks/data/public_domain.txt), per model and format:

- top-1 agreement: teacher-forced, how often the next token kvray predicts equals the one
  the de-quantized fp32 model (the same file's values, `quantization=None`) predicts;
- mean KL(reference || quantized) of the next-token distributions;
- perplexity, scored as `llama-perplexity` scores it (the text in windows of `--ctx`
  tokens, the second half of each window scored), beside llama-perplexity's own on the
  same GGUF and text when `--llama-bin` names its folder.

kvray runs each window as one prefill through the model's own modules (the native
kernels, the activations quantized per group where the weights are codes).

    .venv/bin/python benchmarks/quant_quality.py [--models smollm2-135m-instruct,...] \
        [--llama-bin /path/to/llama.cpp/build/bin] [--ctx 256]
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import torch
from serve_harness import cpu_banner

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
MODES = [  # (label, quantization, dtype, int4's group)
    ("fp32 (file's values)", None, "float32", 32),
    ("gguf, fp32 activations", "gguf", "float32", 32),
    ("gguf, bf16 activations", "gguf", "bfloat16", 32),
    ("int8 (of the file's values)", "int8", "float32", 32),
    ("int4 (of the file's values)", "int4", "float32", 32),
    ("int4, groups of 128", "int4", "float32", 128),
]


def window_logits(
    alias: str, quantization: str | None, dtype: str, group: int, windows: list[list[int]]
) -> torch.Tensor:
    """fp32 logits [windows, ctx, vocab]: each window prefilled alone from position 0."""
    from kvray.engine.config import EngineConfig
    from kvray.engine.model_runner import load_model
    from kvray.kernels.backend import AttentionMetadata, LayerKV, get_backend
    from kvray.models.layers import head_dim_of
    from kvray.models.loader import load_config, resolve_model_path

    path = resolve_model_path(alias)
    config = load_config(path)
    ctx = len(windows[0])
    engine = EngineConfig(
        model=str(path),
        dtype=dtype,
        quantization=quantization,
        quantization_group_size=group,
        max_model_len=ctx,
    )
    model, device, torch_dtype, _ = load_model(engine, config, path)
    block = 16
    blocks = ctx // block
    shape = (blocks, block, config.num_key_value_heads, head_dim_of(config))
    caches = [
        LayerKV(torch.zeros(shape, dtype=torch_dtype), torch.zeros(shape, dtype=torch_dtype))
        for _ in range(config.num_hidden_layers)
    ]
    backend = get_backend("torch", device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(ctx),
        cu_seqlens_q=torch.tensor([0, ctx], dtype=torch.int32),
        seq_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens=[ctx],
        seq_lens_host=[ctx],
        block_size=block,
    )
    backend.prepare(meta)
    out = []
    with torch.no_grad():
        for ids in windows:
            hidden = model(torch.tensor(ids), torch.arange(ctx), caches, backend, meta)
            out.append(model.compute_logits(hidden).float())
    return torch.stack(out)


def windows_of(alias: str, ctx: int) -> list[list[int]]:
    from kvray.models.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(alias))
    ids = tokenizer(TEXT.read_text()).input_ids
    return [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]


def scored(logits: torch.Tensor, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probabilities [scored, vocab] and the true next tokens [scored], the second half
    of each window (llama-perplexity's positions)."""
    ctx = logits.shape[1]
    first = ctx // 2
    logp = torch.log_softmax(logits[:, first - 1 : ctx - 1], dim=-1).reshape(-1, logits.shape[-1])
    targets = torch.tensor([w[first:ctx] for w in windows]).reshape(-1)
    return logp, targets


def llama_perplexity(bin_dir: str, gguf: Path, ctx: int, threads: int) -> float | None:
    cmd = [str(Path(bin_dir) / "llama-perplexity"), "-m", str(gguf), "-f", str(TEXT), "-c", str(ctx),
           "-t", str(threads), "-b", str(ctx)]  # fmt: skip
    env = {"LD_LIBRARY_PATH": bin_dir}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    return float(found.group(1)) if found else None


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--llama-bin", default=None, help="the folder holding llama-perplexity")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvray.errors import InvalidArgumentError
    from kvray.models.fetch import GGUF_NAME
    from kvray.models.loader import resolve_model_path

    print(cpu_banner())
    print(f"text: {TEXT.name}, windows of {args.ctx} tokens, the second half of each scored\n")
    print("| model | weights | top-1 agreement with fp32 | mean KL (nats) | perplexity | llama-perplexity |")
    print("| --- | --- | --- | --- | --- | --- |")
    for alias in args.models.split(","):
        windows = windows_of(alias, args.ctx)
        reference = None
        theirs = "-"
        if args.llama_bin:
            gguf = resolve_model_path(alias) / GGUF_NAME
            ppl = llama_perplexity(args.llama_bin, gguf, args.ctx, args.threads)
            theirs = f"{ppl:.3f}" if ppl is not None else "failed"
        for label, quantization, dtype, group in MODES:
            try:
                logits = window_logits(alias, quantization, dtype, group, windows)
            except InvalidArgumentError as e:  # groups of 128 where a linear's k is not
                print(f"| {alias} | {label} | n/a: {e} | | | |", flush=True)
                continue
            logp, targets = scored(logits, windows)
            ppl = torch.exp(-logp.gather(1, targets[:, None]).mean()).item()
            if reference is None:
                reference = logp
                agree, kl = "1.000", "0"
            else:
                agree = f"{(logp.argmax(-1) == reference.argmax(-1)).float().mean().item():.3f}"
                kl = f"{(reference.exp() * (reference - logp)).sum(-1).mean().item():.4f}"
            cells = [alias, label, agree, kl, f"{ppl:.3f}", theirs if quantization == "gguf" else ""]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
