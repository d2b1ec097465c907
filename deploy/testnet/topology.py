"""An emulated rack as plain, frozen data: hosts, their links, and the names the lab will use.

Nothing here touches the system; :mod:`deploy.testnet.lab` turns a :class:`Topology` into
namespaces, veth pairs and a bridge.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

# Every lab's names start with this, so `clean(DEFAULT_PREFIX_ROOT)` finds leftovers of any run.
DEFAULT_PREFIX_ROOT = "rlab"
PREFIX_PID_DIGITS = 4  # base-36 digits of the maker's pid in a run's prefix (unique_prefix)
RACK_WORKERS_MAX = 154  # 198.18.0.101..254: the workers' part of the rack's /24

# Linux IFNAMSIZ is 16 including the terminating NUL.
IFNAME_MAX = 15

_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
# SI multipliers, as tc(8) reads "kbit"/"mbit"/"gbit".
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
# pyroute2 fills tbf's 32-bit rate field (bytes/s) and has no TCA_TBF_RATE64 support.
_MAX_RATE_BPS = (2**32 - 1) * 8
_HOST_NAME_RE = re.compile(r"^[a-z][a-z0-9]*$")


def _base36(value: int, width: int) -> str:
    digits = []
    for _ in range(width):
        value, rem = divmod(value, 36)
        digits.append(_BASE36[rem])
    return "".join(reversed(digits))


def unique_prefix(root: str = DEFAULT_PREFIX_ROOT) -> str:
    """A name prefix unique to this process and call: root + 4 chars of pid + 2 random chars.

    The pid part keeps parallel runs apart; the random part keeps two labs of one process (or
    a recycled pid after a crash that left debris) apart.
    """
    return root + _base36(os.getpid(), PREFIX_PID_DIGITS) + _base36(secrets.randbelow(36**2), 2)


def parse_rate(rate: str) -> int:
    """Parse a tc-style rate such as ``"100mbit"`` or ``"1gbit"`` into bits per second."""
    match = _RATE_RE.match(rate)
    if match is None:
        raise ValueError(f"rate {rate!r}: expected <number><bit|kbit|mbit|gbit|tbit>")
    bps = int(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])
    if bps <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return bps


def _worker_index(index: int, workers: int) -> int:
    if not 0 <= index < workers:
        raise ValueError(f"impaired worker {index} is not in the rack's 0..{workers - 1}")
    return index


@dataclass(frozen=True)
class Link:
    """One host's cable to the switch; impairments apply to both directions independently."""

    rate: str | None = None  # tc rate, e.g. "1gbit"; None = as fast as veth goes
    delay_ms: float = 0.0  # one-way, per direction (RTT grows by 4 * delay between two hosts)
    loss_pct: float = 0.0
    duplicate_pct: float = 0.0  # % of IPv4 packets sent twice
    # % of IPv4 packets held back so that later ones overtake them. Without delay_ms (no netem)
    # they are held only while traffic flows: see deploy.testnet.shaping.
    reorder_pct: float = 0.0
    mtu: int = 9000

    def __post_init__(self) -> None:
        if self.rate is not None:
            bps = parse_rate(self.rate)
            if bps > _MAX_RATE_BPS:
                raise ValueError(f"rate {self.rate!r} above {_MAX_RATE_BPS} bit/s; use rate=None")
        for label, pct in (
            ("loss_pct", self.loss_pct),
            ("duplicate_pct", self.duplicate_pct),
            ("reorder_pct", self.reorder_pct),
        ):
            if not 0.0 <= pct <= 100.0:
                raise ValueError(f"{label}={pct} outside [0, 100]")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms={self.delay_ms} negative")
        if not 68 <= self.mtu <= 65535:
            raise ValueError(f"mtu={self.mtu} outside [68, 65535]")

    @property
    def rate_bps(self) -> int | None:
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def uses_netem(self) -> bool:
        """Delay needs sch_netem, which then also duplicates and reorders (netem's way:
        reorder_pct of the packets skip the delay)."""
        return self.delay_ms > 0

    @property
    def nft_impaired(self) -> bool:
        """Duplication/reordering done without netem: nftables egress rules plus an HTB tree
        (see deploy.testnet.shaping). Loss is always nftables, in the switch."""
        return not self.uses_netem and bool(self.duplicate_pct or self.reorder_pct)


@dataclass(frozen=True)
class Host:
    name: str  # short, [a-z][a-z0-9]*: it becomes part of interface and namespace names
    address: str  # IPv4, inside Topology.subnet


@dataclass(frozen=True)
class Topology:
    """Workers and appliances, each on its own link to one top-of-rack bridge."""

    name_prefix: str
    workers: tuple[Host, ...]
    appliances: tuple[Host, ...]
    worker_link: Link = field(default_factory=Link)
    appliance_link: Link = field(default_factory=Link)
    subnet: str = "198.18.0.0/24"
    multicast_range: str = "239.255.0.0/16"
    # The workers whose cables carry worker_link's loss, duplication and reordering; None: every
    # worker's. The others get the same rate, delay and MTU, clean: one bad cable in a rack.
    impaired: frozenset[str] | None = None

    def __post_init__(self) -> None:
        net = ipaddress.IPv4Network(self.subnet)
        mcast = ipaddress.IPv4Network(self.multicast_range)
        if not mcast.is_multicast:
            raise ValueError(f"multicast_range {self.multicast_range} is not multicast")
        if not re.fullmatch(r"[a-z][a-z0-9]*", self.name_prefix):
            raise ValueError(f"lab name {self.name_prefix!r}: a lowercase letter, then lowercase "
                             "letters and digits ([a-z][a-z0-9]*)")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names not unique: {names}")
        addresses = [h.address for h in self.hosts]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"host addresses not unique: {addresses}")
        if self.impaired is not None:
            strangers = sorted(self.impaired - {h.name for h in self.workers})
            if strangers:
                raise ValueError(f"impaired names no worker of this rack: {strangers}")
        for host in self.hosts:
            if not _HOST_NAME_RE.match(host.name) or host.name == "tor":
                # "tor" would collide with the switch namespace name.
                raise ValueError(f"host name {host.name!r}: use [a-z][a-z0-9]*, not 'tor'")
            addr = ipaddress.IPv4Address(host.address)
            if addr not in net or addr in (net.network_address, net.broadcast_address):
                raise ValueError(f"{host.name} address {addr} not a host address of {net}")
            # The switch-side port name is the longest: prefix + host name + "s".
            if len(self.port_ifname(host.name)) > IFNAME_MAX:
                room = IFNAME_MAX - (len(self.port_ifname(host.name)) - len(self.name_prefix))
                raise ValueError(
                    f"lab name {self.name_prefix!r} is too long: with host {host.name!r} its "
                    f"interface names pass {IFNAME_MAX} characters (at most {room} here)")

    @classmethod
    def rack(
        cls,
        workers: int = 4,
        appliances: int = 1,
        *,
        rate: str | None = None,
        delay_ms: float = 0.0,
        loss_pct: float = 0.0,
        duplicate_pct: float = 0.0,
        reorder_pct: float = 0.0,
        mtu: int = 9000,
        appliance_link: Link | None = None,
        prefix: str | None = None,
        impaired: Sequence[int] | None = None,
    ) -> Topology:
        """Appliances a0.. at 198.18.0.1.., workers w0.. at 198.18.0.101..; impairments apply
        to worker links (the appliance link is unrestricted unless given), to those of the
        workers numbered in `impaired` alone where it is given."""
        if not 1 <= appliances <= 100 or not 1 <= workers <= RACK_WORKERS_MAX:
            raise ValueError(f"a rack holds 1..100 appliances and 1..{RACK_WORKERS_MAX} workers "
                             f"(one /24), not {appliances} and {workers}")
        base = ipaddress.IPv4Address("198.18.0.0")
        return cls(
            name_prefix=prefix if prefix is not None else unique_prefix(),
            workers=tuple(Host(f"w{i}", str(base + 101 + i)) for i in range(workers)),
            appliances=tuple(Host(f"a{i}", str(base + 1 + i)) for i in range(appliances)),
            worker_link=Link(rate, delay_ms, loss_pct, duplicate_pct, reorder_pct, mtu),
            appliance_link=appliance_link if appliance_link is not None else Link(mtu=mtu),
            impaired=None if impaired is None else frozenset(
                f"w{_worker_index(i, workers)}" for i in impaired),
        )

    @property
    def hosts(self) -> tuple[Host, ...]:
        return self.appliances + self.workers

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in topology {self.name_prefix}")

    def link_of(self, name: str) -> Link:
        host = self.host(name)
        if host not in self.workers:
            return self.appliance_link
        if self.impaired is None or name in self.impaired:
            return self.worker_link
        return replace(self.worker_link, loss_pct=0.0, duplicate_pct=0.0, reorder_pct=0.0)

    # Names. Everything the lab creates starts with name_prefix, which is what clean() relies on.
    def netns_name(self, name: str) -> str:
        return f"{self.name_prefix}-{name}"

    @property
    def switch_netns(self) -> str:
        return f"{self.name_prefix}-tor"

    @property
    def bridge_ifname(self) -> str:
        return f"{self.name_prefix}br"

    def host_ifname(self, name: str) -> str:
        return f"{self.name_prefix}{name}"

    def port_ifname(self, name: str) -> str:
        return f"{self.name_prefix}{name}s"
