"""Steering decisions: plan() is pure, so its rules and notes are checked as values."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.steering import (
    MulticastRoute,
    PortToQueue,
    SocketTos,
    SteeringInputs,
    plan,
    rdma_devices,
)
from reduction_appliance.dataplane.errors import ConfigError


def inputs(**changes: object) -> SteeringInputs:
    base = SteeringInputs(ifname="eth1", segment_bytes=8896,
                          group_range=ipaddress.IPv4Network("239.255.0.0/16"),
                          base_port=7000, cores=4, dscp=46, rx_queues=8)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_mtu_needed_is_payload_plus_header_plus_ip_udp() -> None:
    assert inputs().mtu_needed == 8896 + 48 + 28 == 8972
    assert plan(inputs(segment_bytes=1024)).mtu_needed == 1100


def test_from_config_uses_the_largest_segment_the_mtu_carries() -> None:
    cfg = parse({"dataplane": {"mtu": 9000, "cores": 2, "base_port": 7100, "dscp": 46,
                               "interface": "eth1"},
                 "multicast": {"groups": "239.1.0.0/24"}})
    got = SteeringInputs.from_config(cfg, rx_queues=4)
    assert got.mtu_needed <= 9000 and got.segment_bytes == 8896
    assert (got.ifname, got.base_port, got.cores, str(got.group_range), got.dscp) == (
        "eth1", 7100, 2, "239.1.0.0/24", 46)
    assert SteeringInputs.from_config(cfg, rx_queues=1, ifname="eth9").ifname == "eth9"


@pytest.mark.parametrize("rx_queues", [1, 2, 8])
def test_multicast_route_is_always_planned(rx_queues: int) -> None:
    p = plan(inputs(rx_queues=rx_queues))
    assert p.rules[0] == MulticastRoute("239.255.0.0/16", "eth1")


def test_enough_queues_map_each_core_port_to_its_queue() -> None:
    p = plan(inputs(rx_queues=8))
    assert [r for r in p.rules if isinstance(r, PortToQueue)] == [
        PortToQueue(7000 + i, i, "eth1") for i in range(4)
    ]
    assert any("ntuple" in note for note in p.notes)
    assert PortToQueue(7001, 1, "eth1").ethtool_command() == (
        "ethtool -N eth1 flow-type udp4 dst-port 7001 action 1")


@pytest.mark.parametrize(("rx_queues", "word"), [(1, "1 RX queue "), (3, "3 RX queues ")])
def test_too_few_queues_plans_no_port_steering_and_says_why(rx_queues: int, word: str) -> None:
    p = plan(inputs(ifname="veth0", rx_queues=rx_queues))
    assert not any(isinstance(r, PortToQueue) for r in p.rules)
    note = p.notes[0]
    assert note.startswith(f"veth0 has {word}for 4 cores: per-core steering not possible")
    assert "all cores share" in note


def test_single_core_needs_no_queue_steering() -> None:
    p = plan(inputs(cores=1, rx_queues=1))
    assert p.rules == (MulticastRoute("239.255.0.0/16", "eth1"),)
    assert "no per-core queue steering needed" in p.notes[0]


@pytest.mark.parametrize(("dscp", "tos", "name"), [(46, 0xB8, "EF"), (26, 0x68, "AF31")])
def test_dscp_is_marked_by_the_sockets(dscp: int, tos: int, name: str) -> None:
    p = plan(inputs(dscp=dscp))
    assert p.socket_tos == SocketTos(tos) and p.socket_tos.dscp == dscp
    assert any(f"marked {name} by the data-plane sockets" in n for n in p.notes)


def test_no_dscp_no_marking() -> None:
    p = plan(inputs(dscp=None))
    assert p.socket_tos is None and not any("IP_TOS" in n for n in p.notes)


def test_plan_is_pure_and_describable() -> None:
    assert plan(inputs()) == plan(inputs())
    assert plan(inputs()).describe()[0] == (
        "multicast route 239.255.0.0/16 dev eth1 (table main, scope link)")


def test_group_range_from_the_config_is_normalised() -> None:
    cfg = parse({"multicast": {"groups": "239.1.0.0/255.255.0.0"},
                 "dataplane": {"interface": "eth1", "mtu": 9000}})
    assert plan(SteeringInputs.from_config(cfg, rx_queues=1)).rules[0] == MulticastRoute(
        "239.1.0.0/16", "eth1")


def test_no_interface_no_plan() -> None:
    # Everything else plan() takes was validated by the config loader (see test_config).
    with pytest.raises(ConfigError, match="interface name"):
        plan(inputs(ifname=""))


def test_rdma_devices_is_a_list() -> None:
    assert isinstance(rdma_devices(), list)
