"""The interface a worker's process groups bind to is the one that holds its node's IP."""

import socket

import psutil

from kvray.actors import net

ORIGINALLY_SET = {v for v in net.SOCKET_IFNAME_VARS if v in net.os.environ}


def _unset_restored(monkeypatch, *names: str) -> None:
    """Unset `names` for this test; whatever the test sets them to is undone after it
    (a bare delenv of a variable that is not set records nothing to restore)."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_interface_of_a_local_address_is_found_and_named_for_gloo_and_nccl(monkeypatch):
    loopback = next(
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs)
    )
    assert net.interface_of("127.0.0.1") == loopback
    _unset_restored(monkeypatch, *net.SOCKET_IFNAME_VARS)
    assert net.bind_collectives_to("127.0.0.1") == loopback
    assert [net.os.environ[v] for v in net.SOCKET_IFNAME_VARS] == [loopback, loopback]


def test_a_users_choice_is_kept_and_a_foreign_address_changes_nothing(monkeypatch):
    _unset_restored(monkeypatch, "NCCL_SOCKET_IFNAME")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    net.bind_collectives_to("127.0.0.1")
    assert net.os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert net.interface_of("192.0.2.1") is None  # TEST-NET-1: never a local address
    assert net.bind_collectives_to("192.0.2.1") is None
    assert "NCCL_SOCKET_IFNAME" not in net.os.environ
    assert net.interface_of("not an address") is None


def test_the_tests_leave_no_interface_choice_behind():
    """Every process a later test starts inherits this one's environment (a leaked
    GLOO_SOCKET_IFNAME=lo once made the namespace nodes' groups bind loopback)."""
    assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} & set(net.os.environ) - ORIGINALLY_SET


def test_pulls_from_a_peer_that_cannot_be_reached_share_one_build_then_fail_at_once(monkeypatch):
    """A pair whose peer never joins (another node it cannot reach): the pulls that came
    while it was built fail together after one pull timeout, and the next ones fail at
    once (they recompute) instead of each waiting for a build of its own."""
    import asyncio

    import pytest

    from kvray.actors import kv_transport
    from kvray.actors.kv_transport import KVPullError, TorchDistConnector
    from kvray.configs import KVTransferConfig

    builds = []
    real_host_store = kv_transport.host_store
    monkeypatch.setattr(kv_transport, "host_store", lambda *a: builds.append(a) or real_host_store(*a))

    class Unreachable:  # its join never arrives
        class join_pair:  # noqa: N801 (the shape of a Ray actor method)
            @staticmethod
            def remote(*args):
                return asyncio.get_running_loop().create_future()

    connector = TorchDistConnector(
        "decode-0", KVTransferConfig(pull_timeout_seconds=1.0), "127.0.0.1", "gloo"
    )

    async def scenario():
        first = await asyncio.gather(
            *(connector.links.get("prefill-0", Unreachable()) for _ in range(4)), return_exceptions=True
        )
        assert all(isinstance(r, Exception) for r in first)
        assert len(builds) == 1  # one build for the four pulls, not one each in turn
        with pytest.raises(KVPullError, match="no link to prefill-0"):
            await connector.links.get("prefill-0", Unreachable())
        assert len(builds) == 1  # failed at once, no new build within the pull timeout
        connector.links.failed["prefill-0"] = (0.0, "long ago")  # the timeout has passed
        with pytest.raises(RuntimeError):  # gloo's own error, from a new build
            await connector.links.get("prefill-0", Unreachable())
        assert len(builds) == 2

    asyncio.run(scenario())
    assert connector.links.building == {} and connector.groups == {}


def test_the_namespace_harness_reads_tc_rates_and_refuses_bad_names_and_rates():
    import pytest

    from kvray.cluster.netns import NamespaceCluster
    from kvray.cluster.netns_tools import parse_rate
    from kvray.errors import InvalidArgumentError

    assert [parse_rate(r) for r in ("100mbit", "1gbit", "10Gbit", "1.5gbit", "500kbit")] == [
        100_000_000, 1_000_000_000, 10_000_000_000, 1_500_000_000, 500_000,
    ]  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="rate"):
        parse_rate("fast")
    with pytest.raises(InvalidArgumentError, match="name"):
        NamespaceCluster("a name too long")
    with pytest.raises(InvalidArgumentError, match="nodes"):
        NamespaceCluster("ok", nodes=0)
    cluster = NamespaceCluster("kv", nodes=3, subnet="10.9.8")
    assert [cluster.ip(n) for n in range(3)] == ["10.9.8.10", "10.9.8.11", "10.9.8.12"]
    assert (cluster.ns(2), cluster.bridge_ns, cluster.head_address) == ("kv-2", "kv-br", "10.9.8.10:6379")


def test_the_ray_up_template_is_filled_for_the_cluster():
    import yaml

    from kvray.cluster.netns_ssh import ray_up_config

    config = yaml.safe_load(ray_up_config("kvx", "10.9.8.10", ["10.9.8.11", "10.9.8.12"], "/k/id", "p-1"))
    assert config["cluster_name"] == "kvx"
    assert config["provider"] == {
        "type": "local",
        "head_ip": "10.9.8.10",
        "worker_ips": ["10.9.8.11", "10.9.8.12"],
    }
    assert config["auth"] == {"ssh_user": "root", "ssh_private_key": "/k/id"}
    assert "--config p-1 --host 10.9.8.10" in " ".join(config["head_start_ray_commands"])
    assert "<" not in yaml.safe_dump(config)  # no placeholder left
