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
    assert config.engine["dtype"] == "auto"  # fp32 on a CPU without bf16 instructions
    pools = [config.prefill, config.decode] if disaggregated else [config.mixed]
    assert all(p.num_workers == 1 and p.num_cpus <= 1 for p in pools)
    # the 2-core machine's cores: the colocated worker both; in PD the decode worker's steps
    # both (one core's memory bandwidth is half the machine's) and the prefill worker one
    assert [p.torch_threads for p in pools] == ([1, 2] if disaggregated else [2])
    assert config.router.num_replicas == 2  # the control plane survives a replica
    assert config.embedding.engine == {"model": "all-minilm-l6-v2"} and config.embedding.num_cpus == 0
    if disaggregated:  # CPU caches: received on the decode worker's event loop
        assert config.kv_transfer.connector == "tcp"
    assert build_app(preset) is not None
    assert build_app({"config": preset}) is not None


@pytest.mark.parametrize(
    ("preset", "model", "disaggregated"),
    [
        ("qwen2.5-1.5b-cpu-pd", "qwen2.5-coder-1.5b-instruct", True),
        ("gemma3-270m-cpu", "gemma-3-270m", False),
    ],
)
def test_model_presets_name_their_alias(preset, model, disaggregated):
    from kvray.models.fetch import ALIASES

    config = load_config(preset)
    assert config.engine["model"] == config.model_name == model and model in ALIASES
    assert config.disaggregated is disaggregated and config.engine["dtype"] == "auto"
    assert build_app(preset) is not None


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServeConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="num_replicas"):
        ServeConfig(num_replicas=0)
    with pytest.raises(ValueError, match="config"):
        load_config("no-such-preset")


def test_engine_arguments_are_checked_as_the_config_loads():
    """An `engine:` mistake fails here, naming the pool and the field, not in a remote
    worker once the app has started; a pool's own engine arguments are checked over the
    deployment's."""
    with pytest.raises(ValueError, match="prefill engine: unknown field 'modle'"):
        ServeConfig(engine={"modle": "smollm2-135m-instruct"})
    with pytest.raises(ValueError, match="decode engine: block_size=0"):
        ServeConfig(decode={"engine": {"block_size": 0}})
    with pytest.raises(ValueError, match="mixed engine: dtype='fp7'"):
        ServeConfig(disaggregated=False, mixed={"engine": {"dtype": "fp7"}})
    ServeConfig(disaggregated=False, decode={"engine": {"dtype": "fp7"}})  # a pool not run
    config = ServeConfig(engine={"block_size": 32}, decode={"engine": {"max_num_seqs": 8}})
    assert config.pool_engine("decode") == {"block_size": 32, "max_num_seqs": 8}
    assert config.pool_engine("prefill") == {"block_size": 32}


def test_an_embedding_pool_names_its_model_and_takes_no_planner():
    """The `embedding:` pool's engine is its own (the deployment's does not apply) and
    must name a model; its mistakes fail as the config loads, naming the pool."""
    config = ServeConfig(engine={"block_size": 32}, embedding={"engine": {"model": "all-minilm-l6-v2"}})
    assert config.embedding.engine == {"model": "all-minilm-l6-v2"} and config.embedding.num_workers == 1
    assert ServeConfig().embedding is None  # no pool unless configured
    with pytest.raises(ValueError, match="embedding engine: 'model'"):
        ServeConfig(embedding={"engine": {}})
    with pytest.raises(ValueError, match="embedding engine: 'modle'"):
        ServeConfig(embedding={"engine": {"model": "all-minilm-l6-v2", "modle": 1}})
    with pytest.raises(ValueError, match="embedding engine: dtype='fp7'"):
        ServeConfig(embedding={"engine": {"model": "all-minilm-l6-v2", "dtype": "fp7"}})
    planner = {"ttft_seconds": 1.0, "tpot_seconds": 0.1}
    with pytest.raises(ValueError, match="embedding.autoscaling.planner"):
        ServeConfig(embedding={"engine": {"model": "m"}, "autoscaling": {"planner": planner}})


def test_gpu_preset_validates_with_tensor_parallel_pools():
    from kvray.engine import EngineConfig

    config = load_config("llama3-8b-gpu-pd")
    assert config.disaggregated and config.kv_transfer.connector == "torch_dist"
    assert config.engine["dtype"] == "bfloat16" and config.model_name == config.engine["model"]
    for pool in (config.prefill, config.decode):
        engine = EngineConfig(**{**config.engine, **pool.engine})  # what the pool's workers run
        assert engine.tensor_parallel_size == 2 and engine.dtype == "bfloat16"
        assert pool.num_gpus == 1 and pool.price_per_hour > 0  # one GPU per shard
    assert config.num_replicas >= 1
    assert build_app("llama3-8b-gpu-pd") is not None  # binds only: nothing loads the model


def test_worker_bundles_one_per_shard_with_custom_resources():
    from kvray.actors.launch import worker_bundles
    from kvray.configs import PoolConfig

    pool = PoolConfig(num_cpus=2, num_gpus=1, resources={"kvray_decode": 1})
    bundles = worker_bundles({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, pool)
    assert bundles == [{"CPU": 2, "GPU": 1, "kvray_decode": 1}] * 4
    assert worker_bundles({}, PoolConfig(num_cpus=0.5)) == [{"CPU": 0.5}]
