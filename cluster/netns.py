"""Several Ray nodes on one Linux machine, each in a network namespace of its own.

Each node is a namespace with one interface (`eth0`, its own address from a private
range) joined to a bridge that lives in a namespace of its own, so nothing outside the
namespaces made here gets an address or a route. Every node runs `ray start` (the first
as head) with its own temp dir and custom resources; its link can be shaped (a `tbf`
rate each way, random packet loss by iptables' `statistic` match), cut and healed, and
every process in it killed at once, which is what a lost node looks like to the others.

Needs root and `ip`/`tc` (iproute2); iptables (loss and partitions) is installed from
Debian's registry when missing. `down()` kills every process in the namespaces and
deletes them, and removes the temp dirs, also after a failure halfway up.

    cluster = NamespaceCluster("kvray", nodes=3, resources=[{}, {"kvray_prefill": 1}, {"kvray_decode": 1}])
    cluster.up()
    cluster.run(0, ["curl", f"http://{cluster.ip(0)}:8000/v1/models"])
    cluster.kill(2)
    cluster.down()
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvray.cluster.local import QUIET_LOCAL_RAY
from kvray.cluster.netns_tools import (
    NetnsError,
    check_can_run,
    ensure_debian_package,
    enter_namespace,
    kill_namespace,
    namespaces,
    parse_rate,
    ray_command,
    sh,
)
from kvray.errors import InvalidArgumentError

RAY_PORT = 6379
NODE_UNSET = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "KVRAY_HOST", "RAY_ADDRESS")
STATE_ROOT = Path("/tmp")  # where a cluster's temp dirs and its state file live
# every node's Ray: no token auth or usage stats on this private cluster, its background
# work turned down as `kvray serve` does for its local Ray
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **QUIET_LOCAL_RAY}


@dataclass
class NamespaceCluster:
    """N Ray nodes in namespaces `<name>-0..N-1`, a bridge in `<name>-br`, addresses
    `<subnet>.10 + i`. Node 0 is the head."""

    name: str = "kvray"
    nodes: int = 3
    subnet: str = "10.213.0"
    resources: list[dict] = field(default_factory=list)  # custom resources, one dict per node
    num_cpus: list[float] = field(default_factory=list)  # Ray's CPU count per node (default 2 each)
    rate: str | None = None  # e.g. "1gbit": each link's rate, both ways
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every Ray process
    head_args: list[str] = field(default_factory=list)  # extra `ray start --head` arguments
    head_env: dict[str, str] = field(default_factory=dict)  # extra environment of the head's Ray

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise InvalidArgumentError("nodes", self.nodes, "1..200")
        if len(self.name) > 10 or not self.name.replace("-", "").isalnum():
            raise InvalidArgumentError("name", self.name, "at most 10 letters, digits or '-'")

    # -- names -------------------------------------------------------------------------
    def ns(self, node: int) -> str:
        return f"{self.name}-{node}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    def ip(self, node: int) -> str:
        return f"{self.subnet}.{10 + node}"

    @property
    def head_address(self) -> str:
        return f"{self.ip(0)}:{RAY_PORT}"

    @property
    def root(self) -> Path:
        return STATE_ROOT / f"kvray-netns-{self.name}"

    def temp_dir(self, node: int) -> Path:
        return self.root / f"n{node}"  # short: Ray's socket paths must fit in 107 bytes

    # -- the network -------------------------------------------------------------------
    def up(self, start_ray: bool = True) -> NamespaceCluster:
        """Make the namespaces and links, then start Ray on every node (head first)."""
        if why := check_can_run():
            raise NetnsError(why)
        if self.bridge_ns in namespaces():
            raise NetnsError(f"namespace {self.bridge_ns} exists: `kvray cluster down --name {self.name}`")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._save()
            sh("ip", "netns", "add", self.bridge_ns)
            sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for node in range(self.nodes):
                self._add_node(node)
            if self.rate:
                for node in range(self.nodes):
                    self.shape(node, rate=self.rate)
            if start_ray:
                for node in range(self.nodes):
                    self.start_ray(node)
        except BaseException:
            self.down()
            raise
        return self

    def _add_node(self, node: int) -> None:
        ns, port = self.ns(node), f"v{node}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh(
            "ip",
            "-n",
            self.bridge_ns,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        sh("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def shape(self, node: int, rate: str | None = None, loss: float = 0.0) -> None:
        """Set the node's link: `rate` each way (None: unlimited) and `loss`, the share of
        packets dropped each way (0: none). Replaces what was set before."""
        for ns, dev in ((self.ns(node), "eth0"), (self.bridge_ns, f"v{node}")):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                # a burst of 1 ms at the rate (at least 64 KiB), a queue of 20 ms
                bits = parse_rate(rate)
                burst = max(64 * 1024, bits // 8 // 1000)
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", str(burst), "latency", "20ms")  # fmt: skip
        self._iptables(node, "kvray-loss", loss)

    def partition(self, node: int) -> None:
        """Cut the node off: every packet through its link is dropped, each way."""
        self._iptables(node, "kvray-cut", 1.0)

    def heal(self, node: int) -> None:
        self._iptables(node, "kvray-cut", 0.0)

    def _iptables(self, node: int, chain: str, drop: float) -> None:
        """One chain of ours per purpose, hooked into INPUT and OUTPUT of the node's eth0."""
        if drop <= 0 and not self._has_chain(node, chain):
            return
        ensure_debian_package("iptables", "iptables")
        ipt = ["ip", "netns", "exec", self.ns(node), "iptables", "-w"]
        if not self._has_chain(node, chain):
            sh(*ipt, "-N", chain)
            sh(*ipt, "-A", "INPUT", "-i", "eth0", "-j", chain)
            sh(*ipt, "-A", "OUTPUT", "-o", "eth0", "-j", chain)
        sh(*ipt, "-F", chain)
        if drop >= 1:
            sh(*ipt, "-A", chain, "-j", "DROP")
        elif drop > 0:
            sh(
                *ipt,
                "-A",
                chain,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                str(drop),
                "-j",
                "DROP",
            )

    def _has_chain(self, node: int, chain: str) -> bool:
        if not (shutil.which("iptables") or Path("/usr/sbin/iptables").exists()):
            return False
        return (
            sh(
                "ip", "netns", "exec", self.ns(node), "iptables", "-w", "-n", "-L", chain, check=False
            ).returncode
            == 0
        )

    # -- processes ---------------------------------------------------------------------
    def popen(self, node: int, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` inside the node's namespace (the environment: ours, then Ray's
        settings, then `env`)."""
        # a node is another machine: this one's choice of interface for gloo/NCCL is not its
        host = {k: v for k, v in os.environ.items() if k not in NODE_UNSET}
        full_env = {**host, **RAY_ENV, **self.env, **(env or {})}
        return subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=full_env, **kwargs)

    def run(self, node: int, argv: list[str], env: dict | None = None, timeout: float | None = None,
            check: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
        proc = self.popen(node, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=timeout)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(argv)} on node {node} exited {proc.returncode}: {err[-2000:]}")
        return done

    def call(self, node: int, fn, *args) -> Future:
        """Run `fn(*args)` on a thread of this process that lives in the node's namespace:
        every socket it (and any thread it starts) opens is the node's. Returns its future."""
        future: Future = Future()

        def run() -> None:
            try:
                enter_namespace(self.ns(node))
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                future.set_exception(e)

        threading.Thread(target=run, name=f"netns-{self.ns(node)}", daemon=True).start()
        return future

    def start_ray(self, node: int) -> None:
        """`ray start` on the node (the head, or joining it) with its own temp dir."""
        temp = self.temp_dir(node)
        temp.mkdir(parents=True, exist_ok=True)
        cpus = self.num_cpus[node] if node < len(self.num_cpus) else 2
        resources = self.resources[node] if node < len(self.resources) else {}
        argv = [ray_command(), "start", f"--node-ip-address={self.ip(node)}", f"--num-cpus={cpus}",
                f"--resources={json.dumps(resources)}", "--disable-usage-stats"]  # fmt: skip
        if node == 0:
            argv += ["--head", f"--port={RAY_PORT}", f"--temp-dir={temp}", "--include-dashboard=false",
                     *self.head_args]  # fmt: skip
        else:
            argv += [f"--address={self.head_address}"]
            # a worker node's temp dir is its own too (Ray takes the head's otherwise)
            argv += [f"--temp-dir={temp}"]
        self.run(node, argv, env=self.head_env if node == 0 else None, timeout=120)

    def start_redis(self, node: int, port: int, password: str) -> None:
        """A Redis server on the node (Debian's `redis-server`, installed when missing),
        for the head's GCS to keep its state in (Ray's GCS fault tolerance)."""
        ensure_debian_package("redis-server", "redis-server")
        folder = self.root / f"redis{node}"
        folder.mkdir(parents=True, exist_ok=True)
        argv = ["redis-server", "--bind", self.ip(node), "--port", str(port), "--requirepass", password,
                "--dir", str(folder), "--save", "", "--appendonly", "no", "--daemonize", "yes"]  # fmt: skip
        self.run(node, argv, timeout=30)
        for _ in range(100):
            done = self.run(node, ["redis-cli", "-h", self.ip(node), "-p", str(port), "-a", password, "ping"],
                            check=False, timeout=10)  # fmt: skip
            if "PONG" in done.stdout:
                return
            time.sleep(0.1)
        raise NetnsError(f"redis-server on node {node} does not answer")

    def process(self, node: int, name: str) -> int | None:
        """The pid of the node's process whose command name is `name` (e.g. gcs_server)."""
        for pid in self.pids(node):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                    return pid
            except OSError:
                continue
        return None

    def kill_gcs(self) -> tuple[list[str], dict[str, str]]:
        """SIGKILL the head's GCS; returns its command line and environment (to restart it
        as a supervisor would)."""
        pid = self.process(0, "gcs_server")
        if pid is None:
            raise NetnsError("no gcs_server runs on the head")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
        raw = Path(f"/proc/{pid}/environ").read_bytes().rstrip(b"\0").decode().split("\0")
        env = dict(item.split("=", 1) for item in raw if "=" in item)
        os.kill(pid, signal.SIGKILL)
        return argv, env

    def start_gcs(self, argv: list[str], env: dict[str, str]) -> None:
        """Start the head's GCS again, detached, as it ran before (its output: gcs-restart.log)."""
        log = open(self.root / "gcs-restart.log", "ab")  # noqa: SIM115 (the child keeps it)
        # its own session, reaped by Popen's bookkeeping; `down()` kills it with the head
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(0), *argv], env=env, start_new_session=True,
                                stdout=log, stderr=log)  # fmt: skip
        log.close()
        time.sleep(1)
        if proc.poll() is not None:
            text = (self.root / "gcs-restart.log").read_text(errors="replace")[-2000:]
            raise NetnsError(f"the GCS exited {proc.returncode} on restart: {text}")

    def log_tail(self, node: int, name: str, chars: int = 3000) -> str:
        """The end of a Ray log file of the node's current session (e.g. gcs_server.out)."""
        path = self.temp_dir(node) / "session_latest" / "logs" / name
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"({path}: {e})"

    def pids(self, node: int) -> list[int]:
        done = sh("ip", "netns", "pids", self.ns(node), check=False)
        return [int(p) for p in done.stdout.split()]

    def kill(self, node: int) -> int:
        """SIGKILL every process in the node's namespace (a lost node); returns how many."""
        return kill_namespace(self.ns(node))

    def restart(self, node: int) -> None:
        """A killed node comes back: Ray started again on the same address."""
        self.kill(node)
        self.start_ray(node)

    def down(self) -> None:
        """Kill every process in the namespaces, delete them and the temp dirs."""
        teardown(self.name)

    # -- state, for `kvray cluster down` from another process ----------------------------
    def _save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "cluster.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, name: str) -> NamespaceCluster:
        path = STATE_ROOT / f"kvray-netns-{name}" / "cluster.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise NetnsError(f"no namespace cluster named {name!r} ({path} is missing)") from None


def teardown(name: str) -> None:
    """Remove every namespace `<name>-*` (processes first) and the cluster's temp dirs."""
    ours = [ns for ns in namespaces() if ns.startswith(f"{name}-")]
    for ns in ours:
        kill_namespace(ns)
    for ns in ours:
        sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(STATE_ROOT / f"kvray-netns-{name}", ignore_errors=True)
    for where in (Path("/tmp"), Path("/tmp/ray")):  # Ray's local provider's state (`ray up`)
        for launcher_state in where.glob(f"cluster-{name}.*"):
            launcher_state.unlink(missing_ok=True)
