"""`dtype="auto"`: bf16 on a CPU only where it has bf16 instructions, else fp32; named dtypes as given."""

from __future__ import annotations

import logging

import torch

from kvray.engine import dtype as engine_dtype


def test_cpu_flags_decide(monkeypatch, caplog):
    cpu = torch.device("cpu")
    zen1 = frozenset({"avx", "avx2", "fma", "sse4_2"})
    zen4 = zen1 | {"avx512f", "avx512_bf16"}
    sapphire_rapids = zen1 | {"avx512f", "amx_bf16", "amx_tile"}
    graviton3 = frozenset({"fp", "asimd", "sve", "bf16"})
    for flags, want in [(zen1, torch.float32), (zen4, torch.bfloat16), (sapphire_rapids, torch.bfloat16),
                        (graviton3, torch.bfloat16), (frozenset(), torch.float32)]:  # fmt: skip
        monkeypatch.setattr(engine_dtype, "cpu_flags", lambda flags=flags: flags)
        with caplog.at_level(logging.INFO, logger="kvray.engine.dtype"):
            assert engine_dtype.resolve_dtype("auto", cpu) == want, flags
        assert "dtype auto -> " + str(want).removeprefix("torch.") in caplog.text  # the choice is logged
        caplog.clear()
    assert engine_dtype.resolve_dtype("bfloat16", cpu) == torch.bfloat16  # asked for: given
    assert engine_dtype.resolve_dtype("float16", cpu) == torch.float16


def test_this_machines_flags_are_read():
    flags = engine_dtype.cpu_flags()
    assert engine_dtype.cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
