"""Huge-page memory for the weights' panels and the KV cache (kernels/cpu_memory.py)."""

from __future__ import annotations

import gc
import mmap
import os
import sys

import pytest
import torch
from torch import nn

from kvray.kernels import cpu_native
from kvray.kernels.cpu_memory import HUGE_PAGE, huge_page_zeros
from kvray.models.cpu_linear import gather_panels

THP = sys.platform == "linux" and os.path.isdir("/sys/kernel/mm/transparent_hugepage")


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and line[0] in "0123456789abcdef" and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_huge_page_zeros_is_a_zeroed_aligned_tensor_that_outlives_its_name(dtype):
    shape = (3, 1000, 1001)
    t = huge_page_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % HUGE_PAGE == 0 and t._base is not None  # a view of its mapping
    assert not t.any()
    view = t[2, 999]
    del t
    gc.collect()
    view.fill_(7)  # the mapping lives as long as a view of it
    assert view.double().sum().item() == 7 * 1001


def test_small_tensors_are_plain_zeros():
    t = huge_page_zeros((5, 7), torch.float32)
    assert t.shape == (5, 7) and not t.any()
    assert t._base is None  # torch's own allocation, no mapping of 2 MiB for 140 bytes


@pytest.mark.skipif(not THP, reason="Linux with transparent huge pages")
def test_huge_page_zeros_advises_huge_pages():
    t = huge_page_zeros((HUGE_PAGE * 2,), torch.uint8)
    assert "hg" in mapping_flags(t.data_ptr())  # MADV_HUGEPAGE
    assert "hg" not in mapping_flags(torch.zeros(HUGE_PAGE * 2, dtype=torch.uint8).data_ptr())


class TwoLinears(nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.a, self.b = nn.Module(), nn.Module()
        self.a.panels, self.panels_head = (cpu_native.to_panels(w) for w in weights)
        self.b.panels = None


@pytest.mark.skipif(not THP, reason="Linux with transparent huge pages")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_panels_moves_every_panel_into_huge_page_memory_unchanged(dtype):
    torch.manual_seed(0)
    weights = [torch.randn(100, 64).to(dtype), torch.randn(4096, 576).to(dtype)]
    model = TwoLinears(weights)
    assert gather_panels(model) == 2
    for panels, weight in zip((model.a.panels, model.panels_head), weights):
        expected = cpu_native.to_panels(weight)
        assert (panels.n, panels.k) == (expected.n, expected.k)
        assert torch.equal(panels.data, expected.data)
        assert panels.data.data_ptr() % 64 == 0
        assert "hg" in mapping_flags(panels.data.data_ptr())
    assert model.b.panels is None
