"""The MTU of the data path: what sizes an appliance's segments when `dataplane.mtu` is 0.

A segment travels as one datagram (header + payload + IP and UDP headers), so the largest
segment that never fragments is set by the smallest MTU on the path. The appliance knows its
own end: the interface that holds the data address (jumbo frames on a rack NIC, 65536 on
loopback). Workers check their end when they join (`UdpWorkerTransport.fragmenting_routes`,
asked by `ApplianceClient`) and say so when a job's datagrams would not fit their route.
Also here, since both need it: which interface holds an address (steering checks that one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, cast

from reduction_appliance.dataplane.errors import ConfigError

if TYPE_CHECKING:
    from pyroute2.netlink.exceptions import NetlinkError

__all__ = ["PathMtu", "data_path_mtu", "interface_for_address", "netlink", "netlink_error"]

_AF_INET = 2
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_WILDCARD = "0.0.0.0"


class PathMtu(NamedTuple):
    mtu: int
    where: str  # how it was found, for check-config and status


def netlink(netns: str | None = None) -> Any:
    """A pyroute2 IPRoute in `netns` (None: this process's namespace); a context manager."""
    # Imported here: only a parse that looks the path up needs pyroute2, and `reductionctl
    # status` (which imports the config module) starts faster without it.
    from pyroute2 import IPRoute

    # flags=0: never create a namespace implicitly (pyroute2's default is O_CREAT).
    return IPRoute() if netns is None else IPRoute(netns=netns, flags=0)


def netlink_error() -> type[NetlinkError]:
    """pyroute2's NetlinkError, for `except netlink_error() as exc:` (evaluated only when an
    exception is raised: by then `netlink()` has imported pyroute2)."""
    from pyroute2.netlink.exceptions import NetlinkError

    return cast("type[NetlinkError]", NetlinkError)


def _holding(ipr: Any, address: str) -> list[int]:
    """Indices of the interfaces holding IPv4 `address`; of every one with an IPv4 address
    for the wildcard."""
    return [int(msg["index"]) for msg in ipr.get_addr(family=_AF_INET)
            if address == _WILDCARD
            or address in (msg.get_attr("IFA_ADDRESS"), msg.get_attr("IFA_LOCAL"))]


def _links(ipr: Any) -> dict[int, tuple[str, int, int]]:
    """index -> (name, MTU, flags) of every interface in this network namespace."""
    return {int(link["index"]): (str(link.get_attr("IFLA_IFNAME")), int(link.get_attr("IFLA_MTU")),
                                 int(link["flags"]))
            for link in ipr.get_links()}


def interface_for_address(address: str, netns: str | None = None) -> str | None:
    """The interface holding IPv4 ``address`` (the data address), or None when none does."""
    if address == _WILDCARD:
        return None
    with netlink(netns) as ipr:
        for index in _holding(ipr, address):
            for link in ipr.get_links(index):
                name = link.get_attr("IFLA_IFNAME")
                return str(name) if name is not None else None
    return None


def data_path_mtu(address: str, interface: str = "") -> PathMtu:
    """The MTU of the appliance's end of the data path: the named data `interface`, else the
    interface holding `address`; for the wildcard address the smallest MTU among the interfaces
    that are up with an IPv4 address (no datagram then fragments whichever one a worker uses).
    `ConfigError` when there is none to read."""
    with netlink() as ipr:
        links = _links(ipr)
        holders = _holding(ipr, address)
    if interface:
        for name, mtu, _ in links.values():
            if name == interface:
                return PathMtu(mtu, f"interface {interface} (dataplane.interface)")
        raise ConfigError(f"dataplane.mtu: 0 asks for the MTU of dataplane.interface "
                          f"{interface}, which does not exist here")
    if address != _WILDCARD:
        for index in holders:
            name, mtu, _ = links[index]
            return PathMtu(mtu, f"interface {name}, which holds {address}")
        raise ConfigError(f"dataplane.mtu: 0 asks for the MTU of the interface holding "
                          f"dataplane.address {address}, and no interface here holds it: "
                          "assign the address, or set dataplane.mtu")
    up = [links[index] for index in holders if links[index][2] & _IFF_UP]
    # Loopback carries only this host's workers: a real interface decides when there is one.
    real = [(mtu, name) for name, mtu, flags in up if not flags & _IFF_LOOPBACK]
    candidates = real or [(mtu, name) for name, mtu, _ in up]
    if not candidates:
        raise ConfigError("dataplane.mtu: 0 asks for the MTU of the interfaces serving "
                          "dataplane.address 0.0.0.0, and none is up with an IPv4 address")
    mtu, name = min(candidates)
    return PathMtu(mtu, f"interface {name}, the smallest of those up for 0.0.0.0")
