"""Paged-attention kernels: Triton (GPU, or the Triton interpreter) and a torch reference.

`reshape_and_cache` and `unified_attention` are the Triton kernels' launchers. They are
imported on first access, not with this package: importing `kvray.kernels` (or its torch
`reference` / backends) never needs Triton, and the kernels are decorated only when first
used, so a process can still set `TRITON_INTERPRET=1` after importing the engine. Without
Triton installed the two names are absent (AttributeError).
"""

from __future__ import annotations

import importlib

_TRITON_NAMES = {
    "reshape_and_cache": "kvray.kernels.triton_cache",
    "unified_attention": "kvray.kernels.triton_attention",
}


def __getattr__(name: str):
    module = _TRITON_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'kvray.kernels' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as e:  # triton is not installed
        raise AttributeError(f"kvray.kernels.{name} needs triton: {e}") from e
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_TRITON_NAMES])
