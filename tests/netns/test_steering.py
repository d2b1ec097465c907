"""Steering on a real (private) network namespace: rules appear, and go again.

Each test gets its own namespace holding a veth pair (this kernel has no dummy links); no
packet is ever sent, and nothing is touched outside the namespace.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest
from pyroute2 import IPRoute, netns

from reduction_appliance.control.steering import (
    Steering,
    SteeringInputs,
    check_interface,
    current,
    interface_for_address,
    interfaces_snapshot,
    plan,
    remove,
)
from reduction_appliance.dataplane.errors import ConfigError

GROUPS = ipaddress.IPv4Network("239.255.0.0/16")
ROUTE = "multicast route 239.255.0.0/16 dev v0 (table main, scope link)"


@pytest.fixture
def ns() -> Iterator[str]:
    """A namespace with veth v0 (MTU 9000, up, 10.9.0.1/24) and its peer v1 (MTU 1500, down)."""
    name = f"rsteer{os.getpid()}{secrets.token_hex(2)}"
    netns.create(name)
    try:
        with IPRoute(netns=name, flags=0) as ipr:
            ipr.link("add", ifname="v0", kind="veth", peer={"ifname": "v1"})
            v0 = ipr.link_lookup(ifname="v0")[0]
            ipr.link("set", index=v0, mtu=9000, state="up")
            ipr.addr("add", index=v0, address="10.9.0.1", prefixlen=24)
        yield name
    finally:
        with contextlib.suppress(OSError):
            netns.remove(name)
    assert name not in netns.listnetns()


def ip_routes(ns_name: str) -> list[str]:
    """The multicast routes of every table as `ip route` prints them, up to the device
    ("239.255.0.0/16 dev v0"; proto and linkdown flags vary)."""
    out = subprocess.run(["ip", "-n", ns_name, "route", "show", "table", "all"],
                         capture_output=True, text=True, check=True).stdout
    return [" ".join(line.split()[:3]) for line in out.splitlines() if line.startswith("239.")]


def the_plan(ifname: str = "v0", rx_queues: int = 1) -> Steering:
    return Steering(plan(SteeringInputs(ifname, 8896, GROUPS, 7000, 2, 46, rx_queues)))


def test_check_interface_accepts_a_jumbo_link(ns: str) -> None:
    state = check_interface("v0", 8972, netns=ns, need_multicast=True)
    assert (state.name, state.up, state.mtu, state.multicast) == ("v0", True, 9000, True)
    assert state.rx_queues >= 1 and state.index > 0


def test_check_interface_missing(ns: str) -> None:
    with pytest.raises(ConfigError, match="interface nope0 does not exist in network namespace"):
        check_interface("nope0", 8972, netns=ns)


def test_check_interface_down(ns: str) -> None:
    with pytest.raises(ConfigError, match=r"interface v1 is down.*ip link set v1 up"):
        check_interface("v1", 1000, netns=ns)


def test_check_interface_mtu_too_small(ns: str) -> None:
    with IPRoute(netns=ns, flags=0) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="v0")[0], mtu=1500)
    with pytest.raises(ConfigError) as info:
        check_interface("v0", 8972, netns=ns)
    assert str(info.value) == ("interface v0 has MTU 1500 but segments need 8972: raise the MTU "
                               "or lower dataplane.segment_bytes")


def test_route_installed_then_removed_on_exit(ns: str) -> None:
    steering = the_plan()
    steering.netns = ns
    with steering as s:
        assert ip_routes(ns) == ["239.255.0.0/16 dev v0"]
        assert current("v0", GROUPS, netns=ns) == [ROUTE]
        assert s.installed() == [ROUTE]
    assert ip_routes(ns) == []
    assert current("v0", GROUPS, netns=ns) == []


def test_route_removed_when_the_block_raises(ns: str) -> None:
    with pytest.raises(RuntimeError, match="boom"), Steering(the_plan().plan, netns=ns):
        assert current("v0", GROUPS, netns=ns) == [ROUTE]
        raise RuntimeError("boom")
    assert ip_routes(ns) == []


def test_remove_is_the_same_teardown_and_idempotent(ns: str) -> None:
    p = the_plan().plan
    s = Steering(p, netns=ns).__enter__()  # as if the daemon had crashed with rules in place
    assert current("v0", GROUPS, netns=ns) == [ROUTE]
    assert remove(p, netns=ns) == [ROUTE]
    assert ip_routes(ns) == []
    assert remove(p, netns=ns) == []
    s.close()  # removing what is already gone is fine
    assert ip_routes(ns) == []


def test_applying_twice_gives_one_route_and_the_first_owner_removes_it(ns: str) -> None:
    p = the_plan().plan
    with Steering(p, netns=ns) as first:
        with Steering(p, netns=ns) as second:
            assert ip_routes(ns) == ["239.255.0.0/16 dev v0"]
            assert second.installed() == []
            assert any("already present" in n for n in second.notes)
        assert ip_routes(ns) == ["239.255.0.0/16 dev v0"]
        assert first.installed() == [ROUTE]
    assert ip_routes(ns) == []


def test_a_route_someone_else_added_is_left_alone(ns: str) -> None:
    subprocess.run(["ip", "-n", ns, "route", "add", str(GROUPS), "dev", "v0", "scope", "global"],
                   check=True)
    with Steering(the_plan().plan, netns=ns) as s:
        assert s.installed() == []
    assert ip_routes(ns) == ["239.255.0.0/16 dev v0"]


def test_a_displaced_route_is_put_back(ns: str) -> None:
    subprocess.run(["ip", "-n", ns, "link", "set", "v1", "up"], check=True)
    subprocess.run(["ip", "-n", ns, "route", "add", str(GROUPS), "dev", "v1"], check=True)
    with Steering(the_plan().plan, netns=ns):
        assert ip_routes(ns) == ["239.255.0.0/16 dev v0"]
    assert ip_routes(ns) == ["239.255.0.0/16 dev v1"]


def test_port_to_queue_is_skipped_with_the_ethtool_command(ns: str) -> None:
    steering = the_plan(rx_queues=2)
    steering.netns = ns
    with steering as s:
        assert s.installed() == [ROUTE]  # only the route: queues need NIC ntuple filters
        skipped = [n for n in s.notes if n.startswith("not installed")]
        assert len(skipped) == 2
        assert "ethtool -N v0 flow-type udp4 dst-port 7001 action 1" in skipped[1]


def test_missing_interface_fails_before_installing_anything(ns: str) -> None:
    with pytest.raises(ConfigError, match="does not exist"), \
            Steering(the_plan("nope0").plan, netns=ns):
        pass
    assert ip_routes(ns) == []


def test_snapshot_and_address_lookup(ns: str) -> None:
    assert interface_for_address("10.9.0.1", netns=ns) == "v0"
    assert interface_for_address("10.9.0.2", netns=ns) is None
    with Steering(the_plan().plan, netns=ns):
        snaps = interfaces_snapshot(["v0", "v1", "nope0"], netns=ns)
    assert [(s.name, s.mtu, s.up, s.multicast_routes) for s in snaps] == [
        ("v0", 9000, True, (str(GROUPS),)),
        ("v1", 1500, False, ()),
        ("nope0", 0, False, ()),
    ]


def unroutable_in(ns_name: str, source: str, interface: str) -> str:
    """`multicast_unroutable` run inside the namespace (the probe is a socket: it must be
    opened there)."""
    code = ("import ipaddress, sys; from reduction_appliance.control.steering import "
            "multicast_unroutable as m; print(m(sys.argv[1], sys.argv[2], "
            "ipaddress.IPv4Network('239.255.0.0/16')))")
    return subprocess.run(["ip", "netns", "exec", ns_name, sys.executable, "-c", code, source,
                           interface], capture_output=True, text=True, check=True).stdout.strip()


def test_multicast_is_unroutable_from_a_wildcard_socket_without_a_route(ns: str) -> None:
    assert unroutable_in(ns, "0.0.0.0", "0.0.0.0") == (
        "no route from 0.0.0.0 (multicast interface 0.0.0.0) to 239.255.0.0/16: "
        "Network is unreachable")
    # A core's socket names its multicast interface: the kernel sends there without a route.
    assert unroutable_in(ns, "10.9.0.1", "10.9.0.1") == "None"
    with Steering(the_plan().plan, netns=ns):  # a data interface: steering adds the route
        assert unroutable_in(ns, "0.0.0.0", "0.0.0.0") == "None"


def run_in(ns_name: str, code: str) -> str:
    """Python `code` run inside the namespace (netlink and sockets then see its interfaces);
    its standard output, stripped."""
    done = subprocess.run(["ip", "netns", "exec", ns_name, sys.executable, "-c", code],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


_SEGMENTS = ("from reduction_appliance.control.config import parse; from "
             "reduction_appliance.dataplane.errors import ConfigError\n"
             "for dp in {cases}:\n"
             "    try:\n"
             "        d = parse({{'dataplane': dp}}).dataplane\n"
             "        print(d.mtu, d.max_payload, d.segment_origin, sep='|')\n"
             "    except ConfigError as e:\n"
             "        print('error', e, sep='|')\n")


def test_segments_follow_the_data_interface_mtu_when_mtu_is_0(ns: str) -> None:
    cases = [{"address": "10.9.0.1"}, {"address": "0.0.0.0"},
             {"address": "10.9.0.1", "interface": "v1"}, {"address": "10.9.0.1", "mtu": 1500},
             {"address": "10.9.0.2"}, {"address": "10.9.0.1", "interface": "nope0"}]
    lines = run_in(ns, _SEGMENTS.format(cases=cases)).splitlines()
    assert lines[0] == "9000|8896|MTU 9000 of interface v0, which holds 10.9.0.1"
    # The wildcard: the smallest MTU of the interfaces up with an address (v0, not lo).
    assert lines[1] == "9000|8896|MTU 9000 of interface v0, the smallest of those up for 0.0.0.0"
    assert lines[2] == "1500|1408|MTU 1500 of interface v1 (dataplane.interface)"
    assert lines[3] == "1500|1408|MTU 1500"  # a configured MTU is taken as it is
    assert lines[4].startswith("error|dataplane.mtu: 0 asks for the MTU of the interface "
                               "holding dataplane.address 10.9.0.2, and no interface here")
    assert lines[5] == ("error|dataplane.mtu: 0 asks for the MTU of dataplane.interface "
                        "nope0, which does not exist here")


def _narrow_route(ns: str) -> None:
    """10.20.0.0/24 through v0 with frames of 1500 bytes (the link's are 9000)."""
    subprocess.run(["ip", "-n", ns, "route", "add", "10.20.0.0/24", "dev", "v0", "mtu", "1500"],
                   check=True)


def test_a_worker_names_a_route_narrower_than_the_jobs_segments(ns: str) -> None:
    _narrow_route(ns)
    code = ("from reduction_appliance.plugin.transport import UdpWorkerTransport\n"
            "with UdpWorkerTransport('10.9.0.1') as t:\n"
            "    print(t.route_mtu(('10.9.0.7', 7000)), t.route_mtu(('10.20.0.5', 7000)))\n"
            "    print(t.fragmenting_routes([('10.9.0.7', 7000), ('10.20.0.5', 7000),"
            " ('10.20.0.5', 7000)], 8896))\n"
            "    print(t.fragmenting_routes([('10.20.0.5', 7000)], 1408))\n")
    assert run_in(ns, code).splitlines() == [
        "9000 1500",
        "['10.20.0.5:7000 (route MTU 1500, datagrams 8972)']",  # once, however often named
        "[]",  # 1408 + 48 + 28 = 1484 fits
    ]


def test_datagrams_wider_than_the_route_leave_one_per_call_as_fragments(ns: str) -> None:
    """The kernel refuses to segment datagrams wider than the route's frames (EMSGSIZE), yet
    sends each alone as IP fragments: the batcher falls back for that route only, nothing is
    lost, and the reason is kept for status."""
    _narrow_route(ns)
    code = ("import socket\n"
            "from reduction_appliance.dataplane.udp import DatagramBatcher\n"
            "with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:\n"
            "    b = DatagramBatcher(s)\n"
            "    for dest in [('10.20.0.5', 7000)] * 3 + [('10.9.0.7', 7000)] * 3:\n"
            "        b.add(dest, b'h' * 48, b'p' * 4000)\n"
            "    b.flush()\n"
            "    print(b.take_counts(), b.gso)\n"
            "    print(b.gso_refused)\n")
    counts, reason = run_in(ns, code).splitlines()
    assert counts == "(6, 24288, 0) True"  # all sent; GSO still on for the wide route
    assert reason == ("EMSGSIZE: datagrams of 4048 bytes are wider than the route to "
                      "10.20.0.5:7000 carries in one frame; sent one per call, as IP fragments")
