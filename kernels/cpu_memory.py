"""CPU tensors in memory that Linux may back with 2 MiB pages (transparent huge pages).

A decode step on a CPU streams every weight once (270 MB for SmolLM2 in bf16), and with
4 KiB pages that is 66,000 pages a step, each a TLB miss, each a two-level page walk under
a VM's nested paging. Where the kernel runs transparent huge pages in `madvise` mode (the
default of most distributions), memory asked for with MADV_HUGEPAGE gets 2 MiB pages at
its first touch: measured on the 2-core Zen 4 VM, single-stream decode with the weight
panels in such memory ran 132 against 127 tok/s (median of 10 interleaved rounds, faster
in 9; BENCHMARKS.md). torch's allocator never asks (glibc's heap, as
`engine/cpu_allocator.py` sets it up, or plain mmaps), so the model's panels and the KV
cache are allocated here: one private anonymous mapping each, aligned to 2 MiB, advised
before anything touches it, then touched once here (zeroed, as `torch.zeros` gives them), so
that the kernel finds its huge pages at start-up and not in the middle of a served step.
Elsewhere (no THP, not Linux, a small tensor) it is `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, touch: bool = True) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor, 2 MiB-aligned in memory advised for huge pages
    where the system takes the advice (the mapping lives as long as a view of it).
    `touch=False` leaves its pages for the caller's first writes to fault in (still zero:
    fresh anonymous memory), so a caller filling it piece by piece holds no more than it
    has filled."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # THP not built into this kernel: small pages, still zeroed
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping
    start = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[start : start + nbytes]
    return (tensor.zero_() if touch else tensor).view(dtype).view(shape)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`: whole free
    pages anywhere in the heap, not only at its top), where glibc is the allocator: after
    the weights were copied into huge-page memory, their first copies' pages would stay
    resident in the heap (engine/cpu_allocator.py keeps freed memory there)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)
