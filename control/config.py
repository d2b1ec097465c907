"""The appliance configuration: one frozen, typed tree, loaded once from TOML.

Every rejection names the key and why, so `reductionctl check-config` and a failing
`reductiond` start say exactly what to fix. Unknown keys are errors too: a typo must not silently
fall back to a default.
"""

from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from dataplane.errors import ConfigError
from dataplane.wire import HEADER_SIZE

__all__ = ["ApiConfig", "ApplianceConfig", "DataplaneConfig", "JobDefaults", "MulticastConfig",
           "load", "parse"]

_IP_UDP_HEADERS = 28
_MAX_UDP_PAYLOAD = 65507


@dataclass(frozen=True)
class DataplaneConfig:
    address: str = "127.0.0.1"  # data address the cores bind to
    base_port: int = 7000  # core i listens on base_port + i
    cores: int = 1  # data-plane processes
    cpus: tuple[int, ...] = ()  # CPU each core is pinned to; () = unpinned
    poll: Literal["busy", "adaptive"] = "adaptive"
    spin_us: int = 200
    mtu: int = 9000  # of the data network; sizes segments so datagrams never fragment
    segment_bytes: int = 0  # 0 = the largest that fits the MTU
    slot_capacity: int = 256  # slot pairs per core (the slot memory budget)
    rx_buffers: int = 512
    kernels: str = "auto"

    @property
    def max_payload(self) -> int:
        if self.segment_bytes:
            return self.segment_bytes
        fit = min(self.mtu - _IP_UDP_HEADERS, _MAX_UDP_PAYLOAD) - HEADER_SIZE
        return fit // 64 * 64  # whole cache lines: aligned kernels on every segment


@dataclass(frozen=True)
class MulticastConfig:
    enabled: bool = True
    groups: str = "239.255.0.0/16"
    port: int = 7100
    interface_address: str = ""  # "" = the data address


@dataclass(frozen=True)
class JobDefaults:
    slots: int = 32  # slot pairs per core per job: the worker's window on that core
    idle_timeout_s: float = 600.0


@dataclass(frozen=True)
class ApiConfig:
    listen: str = "127.0.0.1:7070"


@dataclass(frozen=True)
class ApplianceConfig:
    dataplane: DataplaneConfig = field(default_factory=DataplaneConfig)
    multicast: MulticastConfig = field(default_factory=MulticastConfig)
    jobs: JobDefaults = field(default_factory=JobDefaults)
    api: ApiConfig = field(default_factory=ApiConfig)
    source: str = "<defaults>"


def load(path: str | Path) -> ApplianceConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse(raw, source=str(path))


def _section(raw: dict[str, Any], name: str, cls: type[Any]) -> dict[str, Any]:
    section = raw.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = set(cls.__dataclass_fields__)
    for key in section:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
    defaults = cls()
    values: dict[str, Any] = {}
    for key in known:
        default = getattr(defaults, key)
        value = section.get(key, default)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, tuple):
            ok = isinstance(value, list | tuple)
            value = tuple(value) if ok else value
        else:
            ok = isinstance(value, type(default))
        if not ok:
            raise ConfigError(f"{name}.{key}: expected {type(default).__name__}, got {value!r}")
        values[key] = value
    return values


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def parse(raw: dict[str, Any], source: str = "<memory>") -> ApplianceConfig:
    for key in raw:
        if key not in ("dataplane", "multicast", "jobs", "api"):
            raise ConfigError(f"{key}: unknown section (known: api, dataplane, jobs, multicast)")
    dp = _section(raw, "dataplane", DataplaneConfig)
    cpus = dp["cpus"]
    _check(1 <= dp["cores"] <= 64, "dataplane.cores", "must be 1..64")
    _check(not cpus or len(cpus) == dp["cores"], "dataplane.cpus",
           f"lists one CPU per core ({dp['cores']}) or is empty (unpinned)")
    for cpu in cpus:
        _check(isinstance(cpu, int) and not isinstance(cpu, bool) and cpu >= 0,
               "dataplane.cpus", f"entries are CPU numbers >= 0, got {cpu!r}")
    dp["cpus"] = tuple(cast(int, c) for c in cpus)
    _check(dp["poll"] in ("busy", "adaptive"), "dataplane.poll", "must be busy or adaptive")
    _check(1 <= dp["base_port"] <= 65535 - dp["cores"], "dataplane.base_port", "out of range")
    _check(576 <= dp["mtu"] <= 65535, "dataplane.mtu", "must be 576..65535")
    _check(dp["slot_capacity"] >= 1, "dataplane.slot_capacity", "must be >= 1")
    _check(dp["rx_buffers"] >= 16, "dataplane.rx_buffers", "must be >= 16")
    _ip(dp["address"], "dataplane.address")
    dataplane = DataplaneConfig(**dp)
    payload = dataplane.max_payload
    fits = min(dataplane.mtu - _IP_UDP_HEADERS, _MAX_UDP_PAYLOAD) - HEADER_SIZE
    _check(64 <= payload <= fits and payload % 64 == 0, "dataplane.segment_bytes",
           f"must be a multiple of 64 between 64 and {fits} (what MTU {dataplane.mtu} carries)")

    mc = MulticastConfig(**_section(raw, "multicast", MulticastConfig))
    try:
        groups = ipaddress.IPv4Network(mc.groups)
    except ValueError as exc:
        raise ConfigError(f"multicast.groups: {exc}") from exc
    _check(groups.is_multicast, "multicast.groups", f"{mc.groups} is not a multicast range")
    _check(1 <= mc.port <= 65535, "multicast.port", "out of range")
    if mc.interface_address:
        _ip(mc.interface_address, "multicast.interface_address")

    jobs = JobDefaults(**_section(raw, "jobs", JobDefaults))
    _check(1 <= jobs.slots <= dataplane.slot_capacity, "jobs.slots",
           f"must be between 1 and dataplane.slot_capacity ({dataplane.slot_capacity})")
    _check(jobs.idle_timeout_s > 0, "jobs.idle_timeout_s", "must be > 0")

    api = ApiConfig(**_section(raw, "api", ApiConfig))
    host, sep, port = api.listen.rpartition(":")
    _check(bool(sep) and port.isdigit() and 0 <= int(port) <= 65535, "api.listen",
           f"expected HOST:PORT, got {api.listen!r}")
    _ip(host, "api.listen")
    return ApplianceConfig(dataplane, mc, jobs, api, source)


def _ip(value: str, key: str) -> None:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not an IPv4 address") from None
