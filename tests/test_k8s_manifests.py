"""KubeRay manifests (k8s/): they validate against the KubeRay CRDs' own schemas (unknown
fields rejected), their serveConfigV2 builds through kvray's config validation, the Grafana
dashboard queries metrics kvray exposes, and the PodMonitors scrape ports the pods declare."""

from __future__ import annotations

import copy
import functools
import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
CRDS = REPO.parent / "shared" / "data" / "kuberay-crds"
PRESET = REPO / "configs" / "llama3-8b-gpu-pd.yaml"
MANIFESTS = ["rayservice.yaml", "raycluster.yaml"]
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(name: str) -> list[dict]:
    return [d for d in yaml.load_all((K8S / name).read_text(), Loader=Loader) if d]


def the(name: str, kind: str) -> dict:
    (doc,) = [d for d in load(name) if d["kind"] == kind]
    return doc


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]


def serve_config() -> dict:
    return yaml.safe_load(the("rayservice.yaml", "RayService")["spec"]["serveConfigV2"])


# ---- CRD schemas --------------------------------------------------------------------------


def strict(node):
    """A CRD's OpenAPI v3 schema as JSON Schema that, like the API server's pruning, knows
    every field: objects that list `properties` (and neither `additionalProperties` nor
    `x-kubernetes-preserve-unknown-fields`) reject others, so a typo fails instead of being
    dropped. `x-kubernetes-*` keys go (int-or-string is already spelled as anyOf);
    `nullable` becomes a null type."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("enum", "required", "default"):
            out[key] = value
        else:
            out[key] = strict(value)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    open_ended = "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in node and not open_ended:
        out["additionalProperties"] = False
    return out


FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@functools.cache
def crd_validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    if not CRDS.is_dir():
        pytest.skip(f"the KubeRay CRDs are not at {CRDS} (the shared data folder beside the repository)")
    group, version = api_version.split("/")
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=Loader):
            if crd and crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind:
                (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
                schema = strict(entry["schema"]["openAPIV3Schema"])
                jsonschema.Draft7Validator.check_schema(schema)
                return jsonschema.Draft7Validator(schema, format_checker=FORMATS)
    raise AssertionError(f"no CRD for {kind} {api_version} in {CRDS}")


def crd_errors(doc: dict) -> list[str]:
    errors = crd_validator(doc["kind"], doc["apiVersion"]).iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates_against_its_crd(name):
    docs = [d for d in load(name) if d["kind"] in ("RayService", "RayCluster")]
    assert docs, f"{name} holds no RayService or RayCluster"
    for doc in docs:
        assert doc["apiVersion"] == "ray.io/v1"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert crd_errors(doc) == []


def _worker(spec):
    return spec["workerGroupSpecs"][0]


def _container(spec):
    return _worker(spec)["template"]["spec"]["containers"][0]


BREAKAGES = {  # what -> (how, a field the error must name)
    "wrong type": (lambda s: _worker(s).update(minReplicas="1"), "minReplicas"),
    "required field removed": (lambda s: _worker(s).pop("groupName"), "groupName"),
    "unknown top-level field": (lambda s: s.update(enableInTreeAutoScaling=True), "enableInTreeAutoScaling"),
    "typo in a pod template": (
        lambda s: _container(s).update(resource=_container(s).pop("resources")),
        "resource",
    ),
    "value outside an enum": (lambda s: s["autoscalerOptions"].update(upscalingMode="Fast"), "Fast"),
    "int32 overflow": (lambda s: _worker(s).update(maxReplicas=2**31), "maxReplicas"),
    "bad quantity": (lambda s: _container(s)["resources"]["limits"].update(memory="64 GB"), "64 GB"),
}


@pytest.mark.parametrize("name", MANIFESTS)
@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_crd_validation_rejects_a_broken_copy(name, breakage):
    """The check above cannot pass vacuously: each broken copy fails, naming the field."""
    (doc,) = [d for d in load(name) if d["kind"] in ("RayService", "RayCluster")]
    broken = copy.deepcopy(doc)
    breaks, field = BREAKAGES[breakage]
    breaks(cluster_spec(broken))
    errors = crd_errors(broken)
    assert errors and any(field in e for e in errors), errors


def test_dev_cluster_is_the_services_cluster():
    service = the("rayservice.yaml", "RayService")
    assert the("raycluster.yaml", "RayCluster")["spec"] == service["spec"]["rayClusterConfig"]


# ---- the Serve config ---------------------------------------------------------------------


def test_serve_config_builds_the_gpu_preset_with_kvray():
    pytest.importorskip("ray.serve")
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from kvray.engine import EngineConfig
    from kvray.router.app import load_config

    raw = serve_config()
    ServeDeploySchema.model_validate(raw)  # what Serve itself checks on `serve deploy`
    (app,) = raw["applications"]
    assert app["import_path"] == "kvray.router.app:build_app"
    assert app["args"] == yaml.safe_load(PRESET.read_text()), "serveConfigV2 args drifted from the preset"
    module, attr = app["import_path"].split(":")
    build_app = getattr(importlib.import_module(module), attr)
    assert isinstance(build_app(app["args"]), Application)  # binds only: nothing starts

    config = load_config(app["args"])
    assert app["name"] == config.app_name and app["route_prefix"] == "/"
    cluster = cluster_spec(the("rayservice.yaml", "RayService"))
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    pods = {g["groupName"]: g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]}
    assert set(pods) == {"prefill", "decode"}
    for role in pods:
        pool = getattr(config, role)
        engine = EngineConfig(**{**config.engine, **pool.engine})
        shards = engine.tensor_parallel_size * engine.pipeline_parallel_size
        # STRICT_PACK: a worker's bundles share one node, so one pod must hold a whole worker
        assert pool.placement_strategy == "STRICT_PACK"
        limits = pods[role]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == shards * pool.num_gpus
        assert float(limits["cpu"]) >= shards * pool.num_cpus


# ---- Grafana ------------------------------------------------------------------------------


def exposed_kvray_names() -> set[str]:
    """The sample names kvray's /metrics can serve (what `render` gives for a worker and
    the request numbers, parsed back: counters carry _total, histograms _bucket/_sum/_count)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvray.actors.messages import WorkerStats
    from kvray.router import metrics

    worker = WorkerStats("decode-0", "decode", 0, 0, 0.0, 0, 0, 0, 0.0)
    stats = metrics.RequestStats()
    stats.finish(metrics.RequestTimer(stats, num_prompt_tokens=1), "stop")
    text = metrics.render("m", stats.snapshot(), [worker]).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_grafana_dashboard_queries_kvray_metrics():
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    datasource = {v["name"]: v for v in dashboard["templating"]["list"]}["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exprs = []
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            exprs.append(expr)
    used = {name for expr in exprs for name in re.findall(r"kvray:[A-Za-z0-9_]+", expr)}
    exposed = exposed_kvray_names()
    assert used - exposed == set(), f"not exposed by kvray: {sorted(used - exposed)}"
    wanted = """time_to_first_token_seconds_bucket inter_token_latency_seconds_bucket
        e2e_request_latency_seconds_bucket generation_tokens_total prompt_tokens_total
        num_requests_running num_requests_waiting kv_cache_usage_perc prefix_cache_hits_total
        prefix_cache_queries_total kv_transfer_bytes_total kv_transfer_seconds_bucket
        request_cost_usd_sum request_cost_usd_count"""
    assert {f"kvray:{n}" for n in wanted.split()} <= used


# ---- Prometheus ---------------------------------------------------------------------------


def pod_groups(doc: dict):
    """(labels KubeRay gives the pods, the Ray container, rayStartParams) per group."""
    spec = cluster_spec(doc)
    groups = [("head", spec["headGroupSpec"])] + [("worker", g) for g in spec["workerGroupSpecs"]]
    for node_type, group in groups:
        template = group["template"]
        labels = {
            **template["metadata"].get("labels", {}),
            "ray.io/node-type": node_type,
            "ray.io/is-ray-node": "yes",
        }
        yield labels, template["spec"]["containers"][0], group["rayStartParams"]


def test_podmonitors_scrape_ports_the_pods_declare():
    monitors = load("podmonitor.yaml")
    assert {m["kind"] for m in monitors} == {"PodMonitor"}
    serve_port = serve_config()["http_options"]["port"]
    for name in MANIFESTS:
        (doc,) = [d for d in load(name) if d["kind"] in ("RayService", "RayCluster")]
        for monitor in monitors:
            assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
            selector = monitor["spec"]["selector"]
            assert set(selector) == {"matchLabels"}
            matched = [g for g in pod_groups(doc) if selector["matchLabels"].items() <= g[0].items()]
            assert matched, f"{monitor['metadata']['name']} selects no pod of {name}"
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint["path"] == "/metrics"
                for labels, container, params in matched:
                    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                    assert endpoint["port"] in ports, (
                        f"{container['name']} of {name} has no port {endpoint['port']}"
                    )
                    if endpoint["port"] == "metrics":
                        assert ports["metrics"] == int(params["metrics-export-port"])
                    if endpoint["port"] == "serve":  # app-wide numbers: one pod (the head) only
                        assert ports["serve"] == serve_port and labels["ray.io/node-type"] == "head"
