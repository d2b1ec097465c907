"""Flow steering: decided as plain rule values by :func:`plan`, applied by :class:`Steering`.

``plan`` is pure: it turns the data plane's shape (interface, segment size, group range, ports,
cores, DSCP class, RX queue count) into rule values and human notes. ``Steering`` applies the
rules with pyroute2 inside a context manager and removes exactly what it installed on exit;
``remove`` is the same teardown for ``reductionctl clean``.

What each rule becomes on a Linux host:

* ``MulticastRoute``: the job groups' range routed out of the data interface (main table, scope
  link), so the data plane's multicast sends leave on the data NIC without per-socket setup and
  IGMP joins go out there too. Always installed.
* ``PortToQueue``: core i's UDP port onto RX queue i, so that the NIC's interrupt for that queue
  (pinned near core i) feeds that core only. Only a NIC ntuple filter
  (``ethtool -N IF flow-type udp4 dst-port P action Q``) can choose the RX queue: tc runs after
  the queue and the RPS CPU are chosen, so no tc action (u32, flower, skbedit) can change them,
  and ntuple rules are an ethtool ioctl that pyroute2 does not speak. The rule is therefore
  planned, never installed here; ``Steering.notes`` carries the exact ethtool command for the
  operator (see deploy/host-tuning.md, which also describes RFS, the software alternative).
* ``SocketTos``: DSCP marking is done by the data-plane sockets (``IP_TOS``), not by a rule:
  one setsockopt covers unicast and multicast, costs nothing per packet, and this kernel has
  neither skbedit nor pedit actions to mark by tc anyway.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from reduction_appliance.control.config import ApplianceConfig
from reduction_appliance.control.pathmtu import interface_for_address, netlink, netlink_error
from reduction_appliance.control.snapshot import InterfaceSnapshot
from reduction_appliance.dataplane.errors import ConfigError, ReductionError
from reduction_appliance.dataplane.wire import HEADER_SIZE, IP_UDP_HEADERS

__all__ = [
    "IP_UDP_HEADERS",
    "InterfaceState",
    "MulticastRoute",
    "PortToQueue",
    "Rule",
    "SocketTos",
    "Steering",
    "SteeringError",
    "SteeringInputs",
    "SteeringPlan",
    "check_interface",
    "current",
    "interface_for_address",
    "interfaces_snapshot",
    "plan",
    "rdma_devices",
    "remove",
]

_TABLE_MAIN = 254  # RT_TABLE_MAIN
_SCOPE_LINK = 253  # RT_SCOPE_LINK: the range is reached directly on the interface
_IFF_UP = 0x1
_IFF_MULTICAST = 0x1000
_AF_INET = 2
_INFINIBAND = Path("/sys/class/infiniband")
_MULTICAST = ipaddress.IPv4Network("224.0.0.0/4")
# Per-hop behaviour names, so notes and status say "EF" rather than a bare number (RFC 4594).
_DSCP_NAMES = {0: "CS0/best effort", 8: "CS1", 10: "AF11", 18: "AF21", 26: "AF31", 34: "AF41",
               46: "EF", 48: "CS6"}


class SteeringError(ReductionError):
    """Installing or removing a steering rule failed on the host (missing CAP_NET_ADMIN, an
    interface that vanished, a conflicting route). The message names the rule and the kernel's
    answer; fix the host, then restart the appliance or run ``reductionctl clean``."""


# -- rule values -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MulticastRoute:
    prefix: str  # e.g. "239.255.0.0/16"
    ifname: str

    def describe(self) -> str:
        return f"multicast route {self.prefix} dev {self.ifname} (table main, scope link)"


@dataclass(frozen=True)
class PortToQueue:
    port: int  # UDP destination port of one data-plane core
    queue: int  # RX queue whose interrupt is pinned near that core
    ifname: str

    def describe(self) -> str:
        return f"udp dst-port {self.port} -> rx queue {self.queue} on {self.ifname}"

    def ethtool_command(self) -> str:
        return (f"ethtool -N {self.ifname} flow-type udp4 dst-port {self.port} "
                f"action {self.queue}")


@dataclass(frozen=True)
class SocketTos:
    """Not a rule to install: the IP_TOS byte the data-plane sockets set (DSCP << 2)."""

    value: int

    @property
    def dscp(self) -> int:
        return self.value >> 2

    def describe(self) -> str:
        name = _DSCP_NAMES.get(self.dscp, f"DSCP {self.dscp}")
        return f"data traffic marked {name} by the data-plane sockets (IP_TOS 0x{self.value:02x})"


Rule = MulticastRoute | PortToQueue


@dataclass(frozen=True)
class SteeringInputs:
    ifname: str  # the data interface
    segment_bytes: int  # payload bytes per datagram (dataplane.max_payload)
    group_range: ipaddress.IPv4Network  # multicast.groups
    base_port: int  # core i listens on base_port + i
    cores: int
    dscp: int | None  # DSCP class of data traffic (46 EF, 26 AF31, ...); None: unmarked
    rx_queues: int  # the data NIC's RX queue count (InterfaceState.rx_queues)

    @classmethod
    def from_config(cls, config: ApplianceConfig, rx_queues: int,
                    ifname: str | None = None) -> SteeringInputs:
        """Inputs for the configured data plane; ``ifname`` overrides dataplane.interface."""
        dp = config.dataplane
        return cls(ifname or dp.interface, dp.max_payload, config.multicast.groups,
                   dp.base_port, dp.cores, dp.dscp, rx_queues)

    @property
    def mtu_needed(self) -> int:
        """The interface MTU that carries a full segment in one unfragmented datagram."""
        return self.segment_bytes + HEADER_SIZE + IP_UDP_HEADERS


@dataclass(frozen=True)
class SteeringPlan:
    ifname: str
    mtu_needed: int
    rules: tuple[Rule, ...]
    socket_tos: SocketTos | None
    notes: tuple[str, ...]  # what is not steered by a rule here, and why

    def describe(self) -> list[str]:
        return [rule.describe() for rule in self.rules]


def plan(dataplane: SteeringInputs) -> SteeringPlan:
    """Decide the steering rules for a data plane. Pure: no I/O, same inputs, same plan. The
    inputs come from a loaded config (`from_config`), whose loader validated every value."""
    dp = dataplane
    if not dp.ifname:
        raise ConfigError("steering: the data interface name is empty")
    rules: list[Rule] = [MulticastRoute(str(dp.group_range), dp.ifname)]
    notes: list[str] = []
    queues = "RX queue" if dp.rx_queues == 1 else "RX queues"
    if dp.cores == 1:
        notes.append("1 data-plane core: no per-core queue steering needed")
    elif dp.rx_queues >= dp.cores:
        rules += [PortToQueue(dp.base_port + i, i, dp.ifname) for i in range(dp.cores)]
        notes.append(
            f"{dp.ifname} has {dp.rx_queues} {queues}: port-to-queue steering needs NIC ntuple "
            "filters (ethtool -N), which tc cannot express; install them with ethtool and pin "
            "each queue's IRQ next to its core (deploy/host-tuning.md)")
    else:
        notes.append(
            f"{dp.ifname} has {dp.rx_queues} {queues} for {dp.cores} cores: per-core steering "
            f"not possible; all cores share the {queues} (RFS can still move each port's "
            "protocol work to its core's CPU, see deploy/host-tuning.md)")
    tos = None if dp.dscp is None else SocketTos(dp.dscp << 2)
    if tos is not None:
        notes.append(tos.describe() + ", not by a tc rule")
    return SteeringPlan(dp.ifname, dp.mtu_needed, tuple(rules), tos, tuple(notes))


# -- reading the host ------------------------------------------------------------------------


@dataclass(frozen=True)
class InterfaceState:
    name: str
    index: int
    up: bool  # administratively up (IFF_UP)
    carrier: bool  # link detected (a veth whose peer is down has none)
    mtu: int
    rx_queues: int
    multicast: bool  # IFF_MULTICAST: can send and receive multicast


def _where(netns: str | None) -> str:
    return "" if netns is None else f" in network namespace {netns}"


def _index(ipr: Any, ifname: str) -> int | None:
    found: list[int] = ipr.link_lookup(ifname=ifname)
    return found[0] if found else None


def _rx_queues_from_sysfs(ifname: str) -> int:
    # sysfs shows the namespace that mounted it, so this fallback is only right for the root
    # namespace; netlink's IFLA_NUM_RX_QUEUES is used whenever the kernel sends it.
    with contextlib.suppress(OSError):
        return sum(1 for p in Path(f"/sys/class/net/{ifname}/queues").iterdir()
                   if p.name.startswith("rx-"))
    return 1


def _state(ipr: Any, ifname: str, netns: str | None) -> InterfaceState | None:
    index = _index(ipr, ifname)
    if index is None:
        return None
    link = ipr.get_links(index)[0]
    flags = int(link["flags"])
    rxq = link.get_attr("IFLA_NUM_RX_QUEUES")
    if rxq is None:
        rxq = _rx_queues_from_sysfs(ifname) if netns is None else 1
    return InterfaceState(
        name=ifname,
        index=index,
        up=bool(flags & _IFF_UP),
        carrier=bool(link.get_attr("IFLA_CARRIER")),
        mtu=int(link.get_attr("IFLA_MTU")),
        rx_queues=int(rxq),
        multicast=bool(flags & _IFF_MULTICAST),
    )


def check_interface(ifname: str, mtu_needed: int, netns: str | None = None, *,
                    need_multicast: bool = False) -> InterfaceState:
    """The data interface's state; ConfigError when it cannot carry the data plane's traffic."""
    with netlink(netns) as ipr:
        state = _state(ipr, ifname, netns)
    if state is None:
        raise ConfigError(f"interface {ifname} does not exist{_where(netns)}: check the data "
                          "interface name (dataplane.address must be assigned to it)")
    if not state.up:
        raise ConfigError(f"interface {ifname} is down{_where(netns)}: "
                          f"bring it up (ip link set {ifname} up)")
    if state.mtu < mtu_needed:
        raise ConfigError(f"interface {ifname} has MTU {state.mtu} but segments need "
                          f"{mtu_needed}: raise the MTU or lower dataplane.segment_bytes")
    if need_multicast and not state.multicast:
        raise ConfigError(f"interface {ifname} has multicast off: turn it on "
                          f"(ip link set {ifname} multicast on) or set multicast.enabled = false")
    return state


def _route_key(msg: Any) -> tuple[str, int]:
    dst = msg.get_attr("RTA_DST") or "0.0.0.0"
    return f"{dst}/{msg['dst_len']}", int(msg.get_attr("RTA_OIF") or 0)


def _main_routes(ipr: Any) -> Iterator[Any]:
    for msg in ipr.get_routes(family=_AF_INET, table=_TABLE_MAIN):
        table = msg.get_attr("RTA_TABLE") or msg["table"]
        if table == _TABLE_MAIN:
            yield msg


def _describe_route(prefix: str, ifname: str) -> str:
    return MulticastRoute(prefix, ifname).describe()


def current(ifname: str, groups: ipaddress.IPv4Network, netns: str | None = None) -> list[str]:
    """Descriptions of the installed rules for ``ifname`` that concern ``groups``: the
    multicast routes in the main table inside the range, on that interface."""
    with netlink(netns) as ipr:
        index = _index(ipr, ifname)
        if index is None:
            return []
        found = []
        for msg in _main_routes(ipr):
            prefix, oif = _route_key(msg)
            if oif == index and ipaddress.IPv4Network(prefix).subnet_of(groups):
                found.append(_describe_route(prefix, ifname))
    return sorted(found)


def interfaces_snapshot(ifnames: Sequence[str], netns: str | None = None
                        ) -> list[InterfaceSnapshot]:
    """Status of each interface; a missing one reads as MTU 0, down, no routes."""
    out: list[InterfaceSnapshot] = []
    with netlink(netns) as ipr:
        routes = [_route_key(msg) for msg in _main_routes(ipr)]
        for name in ifnames:
            state = _state(ipr, name, netns)
            if state is None:
                out.append(InterfaceSnapshot(name, 0, False, ()))
                continue
            mc = tuple(sorted(prefix for prefix, oif in routes if oif == state.index
                              and ipaddress.IPv4Network(prefix).subnet_of(_MULTICAST)))
            out.append(InterfaceSnapshot(name, state.mtu, state.up, mc))
    return out


def multicast_unroutable(source: str, interface_address: str,
                         groups: ipaddress.IPv4Network) -> str | None:
    """None when the data plane's sockets can send to the multicast groups, else why not.
    The probe is a socket set up as a core's is (bound to `source`, IP_MULTICAST_IF
    `interface_address`), and its UDP connect() is the kernel's own route lookup for exactly
    those sends (no datagram leaves). An explicit multicast interface needs no route; a
    wildcard one does, and without it every multicast result would fail (ENETUNREACH)."""
    group = str(groups.network_address + 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((source, 0))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                            socket.inet_aton(interface_address))
            sock.connect((group, 9))
        except OSError as exc:
            return (f"no route from {source} (multicast interface {interface_address}) to "
                    f"{groups}: {exc.strerror or exc}")
    return None


def rdma_devices() -> list[str]:
    """RDMA devices (e.g. mlx5_0, rxe0) from sysfs; empty when the host has none."""
    try:
        return sorted(p.name for p in _INFINIBAND.iterdir())
    except OSError:
        return []


# -- applying --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Displaced:
    """A route to the same prefix through another interface, put back on exit."""

    prefix: str
    oif: int
    scope: int


def _route_args(prefix: str, oif: int, scope: int = _SCOPE_LINK) -> dict[str, Any]:
    return {"dst": prefix, "oif": oif, "table": _TABLE_MAIN, "scope": scope}


def _delete_route(ipr: Any, prefix: str, oif: int) -> None:
    """Delete one route; absent (ESRCH) or gone with its interface (ENODEV) is fine."""
    try:
        ipr.route("del", **_route_args(prefix, oif))
    except netlink_error() as exc:
        if exc.code not in (errno.ESRCH, errno.ENODEV):
            raise SteeringError(f"cannot remove {prefix} dev #{oif}: {exc}") from exc


class Steering:
    """The plan's rules, installed inside ``with Steering(plan) as s:`` and removed after.

    Installing is idempotent: a rule already present (from a previous run, or another
    Steering) is left as found and not removed on exit; only what this object added goes.
    A route to the same prefix on another interface is replaced and put back on exit.
    """

    def __init__(self, steering_plan: SteeringPlan, netns: str | None = None) -> None:
        self.plan = steering_plan
        self.netns = netns
        self._owned: list[MulticastRoute] = []
        self._displaced: list[_Displaced] = []
        self._runtime_notes: list[str] = []
        self._index: int | None = None
        self._entered = False

    def __enter__(self) -> Steering:
        if self._entered:
            raise SteeringError("a Steering can be entered once")
        self._entered = True
        try:
            with netlink(self.netns) as ipr:
                index = _index(ipr, self.plan.ifname)
                if index is None:
                    raise ConfigError(f"interface {self.plan.ifname} does not exist"
                                      f"{_where(self.netns)}: nothing to steer onto")
                self._index = index
                for rule in self.plan.rules:
                    if isinstance(rule, MulticastRoute):
                        self._add_route(ipr, rule, index)
                    else:
                        self._runtime_notes.append(
                            f"not installed: {rule.describe()} (needs a NIC ntuple filter: "
                            f"{rule.ethtool_command()})")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _add_route(self, ipr: Any, rule: MulticastRoute, index: int) -> None:
        existing = [(_route_key(m), int(m["scope"])) for m in _main_routes(ipr)]
        # Any route of the range on our interface will do (whatever its scope): replacing it
        # would make it ours, and exit would then delete a route someone else relies on.
        if any(key == (rule.prefix, index) for key, _ in existing):
            self._runtime_notes.append(f"{rule.describe()} was already present; left in place")
            return
        displaced = [_Displaced(prefix, oif, scope) for (prefix, oif), scope in existing
                     if prefix == rule.prefix and oif != index]
        try:
            ipr.route("replace", **_route_args(rule.prefix, index))
        except netlink_error() as exc:
            raise SteeringError(f"cannot install {rule.describe()}: {exc}") from exc
        self._owned.append(rule)
        self._displaced += displaced

    def close(self) -> None:
        """Remove what this object installed; idempotent. Tries every rule before raising."""
        owned, displaced, index = self._owned, self._displaced, self._index
        self._owned, self._displaced = [], []
        if index is None or (not owned and not displaced):
            return
        errors: list[str] = []
        with netlink(self.netns) as ipr:
            for rule in reversed(owned):
                try:
                    _delete_route(ipr, rule.prefix, index)
                except SteeringError as exc:
                    errors.append(str(exc))
            for old in displaced:
                try:
                    ipr.route("replace", **_route_args(old.prefix, old.oif, old.scope))
                except netlink_error() as exc:
                    errors.append(f"cannot restore {old.prefix} dev #{old.oif}: {exc}")
        if errors:
            raise SteeringError("; ".join(errors))

    def installed(self) -> list[str]:
        """Descriptions of the rules this object installed and will remove."""
        return [rule.describe() for rule in self._owned]

    @property
    def notes(self) -> list[str]:
        """The plan's notes plus what applying found (rules skipped, rules already present)."""
        return [*self.plan.notes, *self._runtime_notes]


def remove(steering_plan: SteeringPlan, netns: str | None = None) -> list[str]:
    """Remove the plan's rules whoever installed them (``reductionctl clean``); idempotent.

    Returns descriptions of what was removed. Displaced routes cannot be restored here: only
    the Steering that displaced them knew them.
    """
    removed: list[str] = []
    with netlink(netns) as ipr:
        index = _index(ipr, steering_plan.ifname)
        if index is None:  # the interface's routes went with it
            return removed
        present = {_route_key(m) for m in _main_routes(ipr)}
        for rule in steering_plan.rules:
            if isinstance(rule, MulticastRoute) and (rule.prefix, index) in present:
                _delete_route(ipr, rule.prefix, index)
                removed.append(rule.describe())
    return removed
