"""Serve configs: the shipped presets validate and build an app without starting anything."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from kvray.configs import ServeConfig  # noqa: E402
from kvray.router import build_app  # noqa: E402
from kvray.router.app import load_config  # noqa: E402


@pytest.mark.parametrize(
    ("preset", "disaggregated"), [("configs/smollm2-cpu.yaml", False), ("smollm2-cpu-pd", True)]
)
def test_presets_validate_and_build(preset, disaggregated):
    config = load_config(preset)
    assert config.disaggregated is disaggregated
    assert config.engine["dtype"] == "float32"
    pools = [config.prefill, config.decode] if disaggregated else [config.mixed]
    assert all(p.num_workers == 1 and p.num_cpus <= 1 and p.torch_threads == 1 for p in pools)
    if disaggregated:
        assert config.kv_transfer.connector == "torch_dist"
    assert build_app(preset) is not None
    assert build_app({"config": preset}) is not None


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServeConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="config"):
        load_config("no-such-preset")
