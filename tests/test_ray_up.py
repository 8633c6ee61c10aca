"""`ray up` cluster configs and `kvray deploy` onto a running cluster.

Every YAML in cluster/ray-up/ goes through what `ray up` runs before it touches a cloud:
Ray's `prepare_config` (defaults merged) and `validate_config` (ray-schema.json and the
node-type checks); a broken copy must fail there. The AWS head must deploy a preset whose
workers fit a GPU node type and not the head.

End to end (slow): Ray 2.60 cannot `ray up` the `fake_multinode` provider (its defaults file
is missing from the wheel, and `ray up` then fails terminating the provider's built-in head
entry), so the test does what the provider is built for: `RAY_FAKE_CLUSTER=1 ray start
--head --autoscaling-config=cluster/ray-up/fake-multinode.yaml`, own temp dir and ports.
The head has no CPUs; `kvray deploy` (a subprocess, address from RAY_ADDRESS) deploys the
colocated CPU preset, whose worker needs a CPU, so the autoscaler must add a fake node. A
completion then goes through the OpenAI client, and the `ray down` of this cluster (every
process of its temp dir, by pid) leaves nothing behind.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

import kvray.cluster
from kvray.cluster.cli import build_parser, main
from kvray.cluster.deploy import app_url
from kvray.cluster.netns_ssh import ray_up_config
from kvray.cluster.ports import free_port

pytest.importorskip("jsonschema")  # Ray's validator needs it
from ray.autoscaler._private import providers  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

RAY_UP = Path(kvray.cluster.__file__).resolve().parent / "ray-up"
YAMLS = sorted(RAY_UP.glob("*.yaml"))
PRESET = Path(__file__).resolve().parent.parent / "configs" / "smollm2-cpu.yaml"
MODEL = "smollm2-135m-instruct"


def _raw(path: Path) -> dict:
    if path.name == "netns.yaml":  # a template the namespace harness fills in
        filled = ray_up_config("kvray-netns", "10.213.0.10", ["10.213.0.11"], "/k", "smollm2-cpu")
        return yaml.safe_load(filled)
    return yaml.safe_load(path.read_text())


@pytest.fixture
def ray_up_validate(monkeypatch):
    """What `ray up` checks before it reaches the provider: defaults merged, then validated."""

    def validate(config: dict, path: Path) -> dict:
        fake_defaults = Path(providers._load_fake_multinode_defaults_config())
        if config["provider"]["type"] == "fake_multinode" and not fake_defaults.exists():
            # the wheel lacks the provider's example.yaml: our file is complete, so it is its own defaults
            monkeypatch.setitem(providers._DEFAULT_CONFIGS, "fake_multinode", lambda: str(path))
        prepared = prepare_config(copy.deepcopy(config))
        validate_config(prepared)
        return prepared

    return validate


def test_there_are_aws_local_and_fake_multinode_configs():
    assert {_raw(p)["provider"]["type"] for p in YAMLS} == {"aws", "local", "fake_multinode"}


@pytest.mark.parametrize("path", YAMLS, ids=[p.stem for p in YAMLS])
def test_ray_up_yaml_passes_rays_validator(path, ray_up_validate):
    config = ray_up_validate(_raw(path), path)
    assert config["head_node_type"] in config["available_node_types"]


@pytest.mark.parametrize("path", YAMLS, ids=[p.stem for p in YAMLS])
def test_rays_validator_rejects_a_broken_copy(path, ray_up_validate):
    import jsonschema

    misspelt = _raw(path)
    misspelt["max_wokers"] = misspelt.pop("max_workers", 2)
    with pytest.raises(jsonschema.ValidationError, match="max_wokers"):
        ray_up_validate(misspelt, path)
    if "available_node_types" in _raw(path):  # the `local` provider makes its own node type
        bad_resources = _raw(path)
        types = bad_resources["available_node_types"]
        worker = next(t for t in types if t != bad_resources["head_node_type"])
        types[worker]["resources"]["CPU"] = "eight"
        with pytest.raises(jsonschema.ValidationError, match="eight"):
            ray_up_validate(bad_resources, path)
        no_head = _raw(path)
        no_head["head_node_type"] = "missing"
        with pytest.raises(ValueError, match="head_node_type"):
            ray_up_validate(no_head, path)


def _deploy_command(config: dict) -> list[str]:
    """The `kvray deploy ...` arguments the head runs after `ray start`."""
    for command in config["head_start_ray_commands"]:
        if "kvray deploy" in command:
            words = shlex.split(command)
            start = words.index("kvray") + 1
            return words[start : words.index(">")] if ">" in words else words[start:]
    raise AssertionError("no `kvray deploy` in head_start_ray_commands")


@pytest.mark.parametrize("name", ["aws", "local"])
def test_head_deploys_a_shipped_preset_with_a_valid_command_line(name):
    from kvray.router.app import load_config

    args = build_parser().parse_args(_deploy_command(_raw(RAY_UP / f"{name}.yaml")))
    assert args.func.__name__ == "_deploy" and args.address == "auto" and args.host == "0.0.0.0"
    load_config(args.config)  # a preset that ships with kvray


def test_aws_pools_fit_a_gpu_node_type_and_not_the_head():
    from kvray.actors.launch import worker_bundles
    from kvray.router.app import load_config

    config = _raw(RAY_UP / "aws.yaml")
    preset = load_config(build_parser().parse_args(_deploy_command(config)).config)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]["resources"]
    workers = [t["resources"] for name, t in types.items() if name != config["head_node_type"]]
    for role in ("prefill", "decode"):
        pool = getattr(preset, role)
        bundles = worker_bundles({**preset.engine, **pool.engine}, pool)  # all on one node: STRICT_PACK
        need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}

        def fits(resources, need=need):
            return all(resources.get(k, 0) >= v for k, v in need.items())

        assert pool.num_gpus > 0 and not fits(head), (role, need, head)
        assert any(fits(w) for w in workers), (role, need, workers)


def test_app_url_names_the_head_when_proxies_listen_everywhere():
    assert app_url("0.0.0.0", 8000, "10.0.0.5") == "http://10.0.0.5:8000/v1"
    assert app_url("127.0.0.1", 8123, "10.0.0.5") == "http://127.0.0.1:8123/v1"
    assert app_url("::", 8000, "fd00::2") == "http://[fd00::2]:8000/v1"


def test_kvray_deploy_without_an_address_says_how_to_give_one(monkeypatch, capsys):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever Ray this process holds
    assert main(["deploy", "--config", "smollm2-cpu"]) == 2
    err = capsys.readouterr().err
    assert "RAY_ADDRESS" in err and "--address" in err


# ---- the fake multi-node cluster, end to end -------------------------------------------------


def _venv_script(name: str) -> str:
    script = Path(sys.executable).with_name(name)
    return str(script) if script.exists() else name


def _cluster_processes(temp_dir: str, psutil) -> list:
    """Every process of the cluster in temp_dir: those naming it, and their descendants."""
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in me.parents())}
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid not in skip and any(temp_dir in a for a in p.info["cmdline"] or []):
                for q in [p, *p.children(recursive=True)]:
                    found[q.pid] = q
        except psutil.Error:
            pass
    return [p for p in found.values() if p.pid not in skip]


def _alive(procs: list, psutil) -> list:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def _ray_down(temp_dir: str, psutil) -> list:
    """The `ray down` of a `ray start` cluster, limited to it: `ray stop` would stop every Ray
    on the machine. The autoscaler goes first (it would replace nodes), then the rest; SIGKILL
    after a grace period. Returns every process it stopped."""
    stopped = []
    for _ in range(5):
        procs = _cluster_processes(temp_dir, psutil)
        if not procs:
            break
        stopped += procs
        monitors = [p for p in procs if "monitor.py" in " ".join(_cmdline(p))]
        for group in (monitors, procs):
            for p in group:
                try:
                    p.terminate()
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(group, timeout=10)
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=5)
    return stopped


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # gone, or not ours to read
        return []


def _nodes(address: str, env: dict) -> list[dict]:
    """Alive nodes as the GCS sees them (in a subprocess: the test process joins no cluster)."""
    code = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False);"
        "print('NODES', json.dumps([n['Resources'] for n in ray.nodes() if n['Alive']]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(next(line[6:] for line in out.stdout.splitlines() if line.startswith("NODES ")))


@pytest.mark.slow
def test_fake_multinode_cluster_autoscales_for_kvray_deploy_answers_and_goes_away(tmp_path, smollm2_path):
    openai = pytest.importorskip("openai")
    psutil = pytest.importorskip("psutil")
    import ray

    temp_dir = tempfile.mkdtemp(prefix="kvr-")  # short: Ray's socket paths must fit in 107 bytes
    ip = ray.util.get_node_ip_address()  # fake nodes join the GCS at this machine's IP
    gcs_port, http_port = free_port(), free_port()
    address = f"{ip}:{gcs_port}"
    cluster = _raw(RAY_UP / "fake-multinode.yaml")
    cluster["provider"]["gcs_address"] = address
    cluster_yaml = tmp_path / "cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump(cluster))
    config = yaml.safe_load(PRESET.read_text())
    config["engine"].update(model=str(smollm2_path), max_model_len=512, kv_cache_memory_bytes=48 << 20)
    config["mixed"].update(num_cpus=1, torch_threads=1)
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled")
    head_env = {**env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    try:
        subprocess.run(
            [
                _venv_script("ray"),
                "start",
                "--head",
                f"--port={gcs_port}",
                f"--temp-dir={temp_dir}",
                f"--autoscaling-config={cluster_yaml}",
                "--num-cpus=0",  # as in the YAML's head type: every worker needs a new node
                "--object-store-memory=200000000",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                "--disable-usage-stats",
            ],
            env=head_env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        before = _nodes(address, env)
        assert len(before) == 1 and before[0].get("CPU", 0) == 0, before  # the head alone, no CPUs

        deploy = subprocess.run(
            [
                _venv_script("kvray"),
                "deploy",
                "--config",
                str(config_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(http_port),  # the preset's direct ingress listens there, on the head
            ],
            env={**env, "RAY_ADDRESS": address},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deploy.returncode == 0, deploy.stdout[-4000:] + deploy.stderr[-4000:]
        url = f"http://127.0.0.1:{http_port}/v1"
        assert re.search(rf"kvray: deployed at {re.escape(url)}$", deploy.stdout, re.M), deploy.stdout[-2000:]

        added = [n for n in _nodes(address, env) if "node:__internal_head__" not in n]
        assert added and all(n.get("CPU") == 1 for n in added), added  # fake nodes of the YAML's types

        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=2, timeout=120)
        r = client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert r.choices[0].text.strip() and 0 < r.usage.completion_tokens <= 8
    finally:
        stopped = _ray_down(temp_dir, psutil)
        left = _alive(stopped, psutil) + _cluster_processes(temp_dir, psutil)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert len(stopped) > 5  # GCS, raylets, autoscaler, Serve and kvray actors
    assert not left, [(p.pid, _cmdline(p)) for p in left]
