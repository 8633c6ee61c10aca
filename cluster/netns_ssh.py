"""SSH into the namespace nodes, for Ray's cluster launcher (`ray up`): an sshd per node
that gives a session a machine of its own, and cluster/ray-up/netns.yaml filled in.

    cluster = NamespaceCluster("kvray", nodes=3).up(start_ray=False)
    start_ssh(cluster)
    cluster.run(0, ["ray", "up", "-y", str(write_ray_up_config(cluster, "smollm2-cpu"))])
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from kvray.cluster.netns import RAY_ENV, NamespaceCluster
from kvray.cluster.netns_tools import NetnsError, ensure_debian_package, sh

SSH_OPTIONS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
               "-o", "ConnectTimeout=2", "-o", "LogLevel=ERROR"]  # fmt: skip


def ssh_key(cluster: NamespaceCluster) -> Path:
    """The key that lets root into every node."""
    return cluster.root / "ssh" / "id_ed25519"


def node_home(cluster: NamespaceCluster, node: int) -> Path:
    """The node's own home folder (root's home in its SSH sessions)."""
    return cluster.root / f"home{node}"


def start_sshd(cluster: NamespaceCluster, node: int, path_first: str, env: dict[str, str]) -> None:
    """An sshd on the node's address, port 22, that lets root in with `ssh_key`. It runs in
    PID and mount namespaces of its own, so a session sees a machine of its own:
    only the node's processes (`ray stop` there stops only the node's Ray) and its own
    home (`node_home`, whose .bashrc puts `path_first` first on PATH and exports
    `env`, TMPDIR and RAY_TMPDIR: a temp dir of the node's own; the other entries of
    this machine's home are links to them, so Python installs and the kvray cache stay
    shared)."""
    ensure_debian_package("sshd", "openssh-server")
    ensure_debian_package("rsync", "rsync")  # Ray's launcher copies its files with it
    key = ssh_key(cluster)
    keys = key.parent
    keys.mkdir(parents=True, exist_ok=True)
    for path in (key, keys / "host_ed25519"):
        if not path.exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path))
    home, tmp = node_home(cluster, node), cluster.root / f"tmp{node}"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    env = {"TMPDIR": str(tmp), "RAY_TMPDIR": str(tmp), **env}  # Ray's temp dir: the node's own
    (home / ".ssh" / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    (home / ".bashrc").write_text(f"export PATH={shlex.quote(path_first)}:$PATH\n{exports}")
    config = cluster.root / f"sshd{node}.conf"
    config.write_text(
        f"ListenAddress {cluster.ip(node)}\nPort 22\nHostKey {keys / 'host_ed25519'}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
        f"StrictModes no\nPidFile {cluster.root / f'sshd{node}.pid'}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    # The rest of this machine's home (Python installs, the kvray cache) stays reachable:
    # the real home is mounted at realhome<node> and the node's home links to its entries.
    real_home, mirror = Path.home(), cluster.root / f"realhome{node}"
    mirror.mkdir(exist_ok=True)
    for entry in real_home.iterdir():
        link = home / entry.name
        if entry.name not in (".bashrc", ".ssh") and not link.exists() and not link.is_symlink():
            link.symlink_to(mirror / entry.name)
    inner = [
        f"mount --bind {real_home} {mirror}",
        f"mount --rbind {home} {real_home}",
        f"exec /usr/sbin/sshd -D -f {config} -E {cluster.root}/sshd{node}.log",
    ]
    unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    cluster.popen(node, [*unshare, "sh", "-c", " && ".join(inner)], **quiet)
    for _ in range(100):
        probe = ["ssh", "-i", str(key), *SSH_OPTIONS, f"root@{cluster.ip(node)}", "true"]
        if cluster.run(node, probe, check=False, timeout=30).returncode == 0:
            return
        time.sleep(0.2)
    raise NetnsError(f"sshd on node {node} does not let us in (log: {cluster.root}/sshd{node}.log)")


def write_ray_up_config(cluster: NamespaceCluster, preset: str) -> Path:
    """cluster/ray-up/netns.yaml filled in for this cluster (node 0 the head)."""
    workers = [cluster.ip(n) for n in range(1, cluster.nodes)]
    path = cluster.root / "ray-up.yaml"
    path.write_text(ray_up_config(cluster.name, cluster.ip(0), workers, ssh_key(cluster), preset))
    return path


def start_ssh(cluster: NamespaceCluster) -> None:
    """An sshd on every node (see start_sshd), kvray's environment on each node's PATH."""
    for node in range(cluster.nodes):
        start_sshd(cluster, node, str(Path(sys.executable).parent), {**RAY_ENV, **cluster.env})


def ray_up_config(name: str, head_ip: str, worker_ips: list[str], key_path: Path | str, preset: str) -> str:
    """The text of cluster/ray-up/netns.yaml with its <placeholders> filled in."""
    text = (Path(__file__).parent / "ray-up" / "netns.yaml").read_text()
    fill = {"<head-ip>": head_ip, "<worker-ips>": json.dumps(worker_ips), "<ssh-key>": str(key_path)}
    for key, value in {**fill, "<preset>": preset}.items():
        text = text.replace(key, value)
    return text.replace("cluster_name: kvray-netns", f"cluster_name: {name}")
