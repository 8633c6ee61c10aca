"""Deploying the Serve app onto a Ray cluster that is already running (`kvray deploy`).

`kvray serve` owns its Ray: it may start one and tears down what it started. `kvray deploy`
owns nothing: it connects to a running cluster (a `ray up` head, a KubeRay head pod, a
`ray start` cluster), starts Serve's HTTP proxies if Serve is not running there yet,
deploys `kvray.router.app:build_app(config)`, waits until the app is RUNNING, prints its
URL and disconnects. The app stays on the cluster; `serve shutdown` (or
`serve.delete(<app_name>)`) removes it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from kvray.configs import ServeConfig
from kvray.errors import InvalidArgumentError

ProxyLocation = Literal["HeadOnly", "EveryNode"]
ALL_INTERFACES = ("0.0.0.0", "::", "")


def cluster_address(address: str | None) -> str:
    """The cluster to join: `--address`, else RAY_ADDRESS; a deploy never starts a Ray."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise InvalidArgumentError(
            "address",
            address,
            "a running Ray cluster: --address HOST:PORT (`auto` on one of its nodes) or RAY_ADDRESS; "
            "`kvray serve` starts a local Ray instead",
        )
    return address


def run_app(
    config: ServeConfig, host: str, port: int, proxy_location: ProxyLocation | None = None
) -> tuple[str, int]:
    """Start Serve's proxies on host:port (unless Serve already runs) and deploy the app,
    returning once it is RUNNING. Returns the host and port the proxies listen on: those
    of the Serve instance already running, when there was one (Serve keeps its HTTP
    options and logs a warning). With `direct_ingress` the app's ingress replicas listen
    on host:port themselves (on the head node) and a Serve started here has no proxy."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from kvray.router.app import build_app

    if config.direct_ingress:
        config = config.model_copy(update={"http_host": host, "http_port": port})
        serve.start(proxy_location="Disabled")
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        return host, port
    serve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    serve.run(build_app(config), name=config.app_name, route_prefix="/")
    http = _get_global_client().http_config
    return http.host, http.port


def head_ip() -> str:
    """The IP of the connected cluster's head node."""
    import ray

    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def app_url(host: str, port: int, head: str) -> str:
    """The OpenAI base URL: proxies bound to every interface are reached at the head's IP."""
    host = head if host in ALL_INTERFACES else host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/v1"


def deploy(
    config: ServeConfig | dict | str | Path,
    address: str | None = None,
    host: str = "0.0.0.0",
    port: int = 8000,
    proxy_location: ProxyLocation | None = None,
) -> str:
    """Deploy the app onto the running cluster at `address` (or RAY_ADDRESS; the cluster
    this process is connected to, if it is) and return its URL. Only a connection made here
    ends here; the app keeps running."""
    import ray

    from kvray.router.app import load_config

    config = load_config(config)  # a bad config fails before anything touches the cluster
    connect = not ray.is_initialized()
    if connect:
        ray.init(address=cluster_address(address))
    try:
        listen_host, listen_port = run_app(config, host, port, proxy_location)
        return app_url(listen_host, listen_port, head_ip())
    finally:
        if connect:
            ray.shutdown()  # a driver that joined a cluster disconnects; it stops nothing there
