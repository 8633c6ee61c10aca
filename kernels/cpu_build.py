"""Building the native CPU kernels (kernels/cpu_*.c) for this machine and loading them:
`library()` compiles the sources with the machine's C compiler for this processor
(`-march=native`) into the user's cache (`$KVRAY_CACHE`, default `~/.cache/kvray`, as for
models), keyed by the source, the compiler and the CPU's flags, so each machine builds it
once (seconds), and declares each entry point's C signature. The typed wrappers
callers use are in kernels/cpu_native.py. A library file there that another user owns, or
that others may write, is never loaded (it runs in every kvray process): it is built anew.

Without a compiler, or with `KVRAY_NATIVE_KERNELS=0`, `library()` is None (the reason
logged once) and the callers use their pure-torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)
SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_decode.c",
        "cpu_prefill.c",
        "cpu_ops.c",
        "cpu_linear.c",
        "cpu_linear_q8.c",
        "cpu_linear_qg.c",
        "cpu_layer.c",
    )
]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_vec.h", "cpu_decode.h", "cpu_share.h")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# KVRAY_NATIVE_CHECKS=1 (read once, as the library loads): a checked build, its own file,
# that stops the process naming any block id or slot outside the cache before a kernel
# touches it (kernels/cpu_decode.h); the test suite runs on it
CHECK_FLAGS = ["-DKVRAY_CHECKS"]


def _flags() -> list[str]:
    return FLAGS + (CHECK_FLAGS if os.environ.get("KVRAY_NATIVE_CHECKS", "0") == "1" else [])


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _cache_dir() -> Path:
    root = os.environ.get("KVRAY_CACHE", Path.home() / ".cache" / "kvray")
    return Path(root) / "native"


def _target(compiler: str) -> Path:
    """Where this machine's build of these sources with this compiler lives."""
    source = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            [source, " ".join(_flags()).encode(), version.encode(), " ".join(sorted(cpu_flags())).encode()]
        )
    )
    return _cache_dir() / f"kvray_cpu_{key.hexdigest()[:16]}.so"


def _own(info: os.stat_result) -> bool:
    """This user's, and no one else may write it."""
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def trusted(path: Path) -> bool:
    """A file fit to load as code: a regular file (not a link), this user's own and
    writable by no one else, in a folder no one else may write to either."""
    info = path.lstat()
    return stat.S_ISREG(info.st_mode) and _own(info) and _own(path.parent.stat())


def _load(path: Path) -> ctypes.CDLL:
    """Load the library through a descriptor of the file checked (so it cannot be swapped
    between the check and the load)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if not (_own(os.fstat(fd)) and _own(path.parent.stat())):
            raise RuntimeError(f"{path} is not this user's own, or others may write it")
        return ctypes.CDLL(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path))
    finally:
        os.close(fd)


def _compile(compiler: str, out: Path) -> None:
    result = subprocess.run(
        [compiler, *_flags(), *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")


def _build(compiler: str) -> Path:
    target = _target(compiler)
    if target.exists():
        if trusted(target):
            return target
        logger.warning("kvray: %s is not this user's own, or others may write it: building it anew", target)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builders: last rename wins
        built = Path(tmp) / target.name
        _compile(compiler, built)
        os.chmod(built, 0o755)
        os.replace(built, target)
    if not trusted(target):  # (replaced meanwhile by someone else's file)
        raise RuntimeError(f"{target} is not this user's own, or others may write it")
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library, or None (logged) when it cannot be built here."""
    if os.environ.get("KVRAY_NATIVE_KERNELS", "1") == "0":
        logger.info("kvray: native CPU kernels off (KVRAY_NATIVE_KERNELS=0)")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("kvray: no C compiler found; CPU decode attention runs on the pure-torch path")
        return None
    try:
        lib = _load(_build(compiler))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        logger.warning("kvray: native CPU kernels unavailable (%s); using the pure-torch path", e)
        return None
    i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for suffix in ("f32", "bf16"):
        for fn, args in (
            (f"kvray_rms_norm_{suffix}", [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, f32, i32]),
            (f"kvray_rotary_{suffix}", [ptr, i64, i64, i64, ptr, ptr, i64, i32]),
            (f"kvray_linear_{suffix}", [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]),
        ):
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = None, args
        # int8 weight panels (cpu_linear_q8.c) and grouped low-bit codes (cpu_linear_qg.c),
        # x and out of this dtype: kvray_linear's arguments
        for weights in ("i8", "q"):
            fn = getattr(lib, f"kvray_linear_{weights}_{suffix}")
            fn.restype, fn.argtypes = None, [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    # q, its stride, out, its stride, k and v caches, block tables, their stride, seq_lens,
    # rows, then num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
    # window, threads
    decode_args = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, *[i32] * 6, f32, i32, i32]
    decoders = ("f32", "i8", "bf16", "i8_bf16")
    for fn in (getattr(lib, f"kvray_paged_decode_{name}") for name in decoders):
        fn.restype, fn.argtypes = None, decode_args
    # layers, their count, shape, x, rows, cos, sin, slots, block tables, their stride,
    # seq_lens, q rows, num_seqs, threads
    layers_args = [ptr, i32, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i32, i32]
    for fn in (lib.kvray_decode_layers_f32, lib.kvray_decode_layers_bf16):
        fn.restype, fn.argtypes = None, layers_args
    # layers, their count, shape, x, rows, embedding, vocab, tokens, cos and sin tables,
    # max positions; then positions, slots, block tables, their stride, seq_lens, q rows,
    # num_seqs, threads
    step_args = [ptr, i32, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64]
    step_args += [ptr, ptr, ptr, i64, ptr, ptr, i32, i32]
    for fn in (lib.kvray_decode_step_f32, lib.kvray_decode_step_bf16):
        fn.restype, fn.argtypes = i32, step_args
    # q, its row stride, k, v, their row stride, out, its row stride, q_len, kv_len,
    # num_q_heads, num_kv_heads, head_dim, scale, threads
    prefill_args = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i32, i32, i32, f32, i32]
    for fn in (lib.kvray_prefill_attention_f32, lib.kvray_prefill_attention_bf16):
        fn.restype, fn.argtypes = None, prefill_args
    lib.kvray_argmax_f32.restype, lib.kvray_argmax_f32.argtypes = None, [ptr, i64, i64, i64, ptr, i32]
    lib.kvray_set_share_redo_ns.restype, lib.kvray_set_share_redo_ns.argtypes = i64, [i64]
    lib.kvray_linear_q_native.restype, lib.kvray_linear_q_native.argtypes = i32, []
    # grouped codes' rows: panels, n, k, ids, their count, out, bf16 out
    lib.kvray_linear_q_rows.restype, lib.kvray_linear_q_rows.argtypes = (
        None,
        [ptr, i64, i64, ptr, i64, ptr, i32],
    )
    return lib
