"""Resolves the `model` argument to a folder and builds a loaded kvray model from it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from kvray.errors import InvalidArgumentError, UnknownModelError
from kvray.models.fetch import ALIASES, FOLDERS, fetch_alias, fetch_folder, fetch_gguf
from kvray.models.gguf_file import GGUF_NAME, iter_gguf
from kvray.models.gguf_groups import attach
from kvray.models.parallel import ShardContext
from kvray.models.registry import model_class

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model_path(model: str) -> Path:
    """An alias, a local `.gguf` file or Hugging Face folder, or a hub id (fetched with
    huggingface_hub)."""
    if model in ALIASES:
        return fetch_alias(model)
    if model in FOLDERS:
        return fetch_folder(model)
    if os.path.isdir(model):
        return Path(model)
    if model.endswith(".gguf") and os.path.isfile(model):
        return fetch_gguf(model)
    allowed = (
        f"an alias in {sorted(ALIASES | FOLDERS)}, a local .gguf file or Hugging Face folder, or a hub id"
    )
    if not _HUB_ID.match(model):
        raise UnknownModelError("model", model, allowed)
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
            )
        )
    except Exception as e:  # network refused, repository missing, ...
        raise UnknownModelError("model", model, f"{allowed} (hub fetch failed: {type(e).__name__})") from e


def load_config(path: Path):
    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: Path):
    """The folder's Hugging Face tokenizer, or None for a weights-only folder (token-id prompts)."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def iter_weights(path: Path, config, skip: Callable[[str], bool] = lambda name: False):
    """(Hugging Face name, tensor) for each weight of the folder that `skip` does not
    refuse: its safetensors, or else its GGUF's tensors de-quantized one at a time."""
    files = sorted(path.glob("*.safetensors"))
    if not files and (path / GGUF_NAME).exists():
        yield from iter_gguf(path / GGUF_NAME, config, skip)
        return
    if not files:
        raise UnknownModelError(
            "model", str(path), f"a folder holding *.safetensors weights or a {GGUF_NAME}"
        )
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if not skip(name):
                    yield name, f.get_tensor(name)


def transformers_model(path: Path, dtype: torch.dtype):
    """The folder's model in transformers (its GGUF read by transformers where the folder
    holds no safetensors): the reference the tests and benchmarks compare against."""
    from transformers import AutoModelForCausalLM

    gguf = {} if any(path.glob("*.safetensors")) else {"gguf_file": GGUF_NAME}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **gguf).eval()


def build_model(
    config,
    path: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    shard: ShardContext | None = None,
    quantization: str | None = None,
    ignore: tuple[str, ...] = (),
):
    """Instantiate the architecture's class (this shard's part of it) and load weights
    (random init when path is None: the same full-model draw on every shard only when
    seeds match, so sharded random models are for shapes, not for parity).
    `quantization="gguf"`: the linears the folder's GGUF holds quantized are read as codes
    (models/gguf_groups.py attach) and never in full precision, but for the modules `ignore`
    names."""
    checkpoints = getattr(config, "quantization_config", None)
    if checkpoints:
        method = checkpoints.get("quant_method") if isinstance(checkpoints, dict) else checkpoints
        raise InvalidArgumentError(
            "model",
            str(path) if path is not None else "<config>",
            f"an unquantized checkpoint: its quantization_config (quant_method {method!r}) "
            "is not a method kvray runs",
        )
    cls = model_class(config)
    with torch.device(device):
        model = cls(config, max_positions, shard)
    held: set[str] = set()
    if quantization == "gguf":
        if path is None or not (path / GGUF_NAME).exists():
            raise InvalidArgumentError(
                "quantization", quantization, "a model loaded from a GGUF file (an alias or a .gguf path)"
            )
        held = attach(model, path / GGUF_NAME, ignore)
    if path is not None:
        try:
            model.load_weights(iter_weights(path, config, lambda name: name in held or not model.needs(name)))
        except InvalidArgumentError as e:
            raise InvalidArgumentError("model", str(path), e.allowed) from None
    else:
        init_random_weights(model, getattr(config, "initializer_range", 0.02))
    model.to(dtype)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, std: float) -> None:
    """Random weights for shape-only models (benchmarks, tests): matrices N(0, std),
    biases 0, norm scales 1, as Hugging Face initialises Llama-family models."""
    for name, param in model.named_parameters():
        if param.dim() > 1:
            param.normal_(0.0, std)
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.zero_()
