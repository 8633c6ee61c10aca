"""`kvray cluster ...`: a cluster of network namespaces on this machine, for a person to
use (the same harness the node-fault tests use; see cluster/netns.py).

    kvray cluster up --nodes 3 --rate 1gbit --resources '[{}, {"kvray_prefill": 1}, {"kvray_decode": 1}]'
    kvray cluster exec 0 -- kvray deploy --address 10.213.0.10:6379 \
        --config smollm2-cpu-pd-nodes --host 10.213.0.10
    kvray cluster kill 2          # every process of node 2, as if it lost power
    kvray cluster restart 2       # Ray back on node 2
    kvray cluster partition 1 / heal 1 / shape 1 --rate 100mbit --loss 0.05
    kvray cluster down

With `up --ssh PRESET` no Ray starts: every node runs an sshd instead and Ray's cluster
launcher brings the cluster up (cluster/ray-up/netns.yaml, filled in and printed).
"""

from __future__ import annotations

import argparse
import json
import os

from kvray.cluster.netns import NamespaceCluster, teardown
from kvray.cluster.netns_ssh import ssh_key, start_ssh, write_ray_up_config

DEFAULT_NAME = "kvray"


def _up(args: argparse.Namespace) -> int:
    resources = json.loads(args.resources) if args.resources else []
    cluster = NamespaceCluster(args.name, args.nodes, args.subnet, resources, rate=args.rate)
    cluster.up(start_ray=not args.ssh)
    for node in range(cluster.nodes):
        print(f"node {node}: namespace {cluster.ns(node)}, {cluster.ip(node)}", flush=True)
    if args.ssh:
        start_ssh(cluster)
        config = write_ray_up_config(cluster, args.ssh)
        print(f"sshd on every node (key {ssh_key(cluster)}); Ray's launcher config: {config}")
        print(f"  kvray cluster exec 0 -- env RAY_UP_enable_autoscaler_v2=0 ray up -y {config}")
    else:
        print(f"Ray head: {cluster.head_address}  (run on it: kvray cluster exec 0 -- <command>)")
    return 0


def _down(args: argparse.Namespace) -> int:
    teardown(args.name)
    return 0


def _exec(args: argparse.Namespace) -> int:
    cluster = NamespaceCluster.load(args.name)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = {"RAY_ADDRESS": cluster.head_address}
    return cluster.popen(args.node, command, env).wait()


def _node_action(action: str):
    def run(args: argparse.Namespace) -> int:
        cluster = NamespaceCluster.load(args.name)
        if action == "shape":
            cluster.shape(args.node, rate=args.rate, loss=args.loss)
        else:
            getattr(cluster, action)(args.node)
        return 0

    return run


def add_parser(sub) -> None:
    cluster = sub.add_parser("cluster", help="Ray nodes in network namespaces on this machine (root)")
    verbs = cluster.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="make the namespaces and start Ray on each (node 0: head)")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--rate", default=None, help="each link's rate, both ways (tc's spelling: 1gbit)")
    up.add_argument("--subnet", default="10.213.0", help="the first three octets; node i gets .10+i")
    up.add_argument(
        "--resources", default=None, help="JSON list of each node's custom Ray resources, node 0 first"
    )
    up.add_argument(
        "--ssh",
        metavar="PRESET",
        default=None,
        help="start no Ray: an sshd on every node and cluster/ray-up/netns.yaml filled in for `ray up` "
        "(the head deploys PRESET)",
    )
    up.set_defaults(func=_up)
    down = verbs.add_parser("down", help="kill everything in the namespaces and delete them")
    down.set_defaults(func=_down)
    exe = verbs.add_parser("exec", help="run a command on a node (RAY_ADDRESS set to the head)")
    exe.add_argument("node", type=int)
    exe.add_argument("command", nargs=argparse.REMAINDER)
    exe.set_defaults(func=_exec)
    for action, text in (
        ("kill", "SIGKILL every process of the node"),
        ("restart", "kill the node's processes and start Ray on it again"),
        ("partition", "drop every packet of the node's link"),
        ("heal", "end a partition"),
        ("shape", "set the node's link rate and packet loss"),
    ):
        verb = verbs.add_parser(action, help=text)
        verb.add_argument("node", type=int)
        if action == "shape":
            verb.add_argument("--rate", default=None)
            verb.add_argument("--loss", type=float, default=0.0, help="share of packets dropped each way")
        verb.set_defaults(func=_node_action(action))
    for parser in (cluster, *verbs.choices.values()):
        parser.add_argument("--name", default=os.environ.get("KVRAY_NETNS_NAME", DEFAULT_NAME))
