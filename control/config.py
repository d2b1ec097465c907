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

__all__ = ["ApiConfig", "ApplianceConfig", "DataplaneConfig", "JobDefaults", "MetricsConfig",
           "MulticastConfig", "load", "parse", "read_token", "split_host_port"]

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
    slot_memory_mb: int = 64  # per core: accumulators and results of every admitted job
    rx_buffers: int = 512
    kernels: str = "auto"
    interface: str = ""  # data interface: checked and steered when set (see steering.py)
    dscp: int = 26  # DSCP class marked on data-plane datagrams (AF31)

    @property
    def max_payload(self) -> int:
        if self.segment_bytes:
            return self.segment_bytes
        fit = min(self.mtu - _IP_UDP_HEADERS, _MAX_UDP_PAYLOAD) - HEADER_SIZE
        return fit // 64 * 64  # whole cache lines: aligned kernels on every segment

    @property
    def slot_pair_bytes(self) -> int:
        """Arena bytes of one slot pair: two copies of an fp32 accumulator (twice a 16-bit
        segment) and a result buffer (see dataplane/slots.py)."""
        return 2 * 3 * self.max_payload

    @property
    def slot_capacity(self) -> int:
        """Slot pairs per core that fit the slot memory budget."""
        return self.slot_memory_mb * 2**20 // self.slot_pair_bytes


@dataclass(frozen=True)
class MulticastConfig:
    enabled: bool = True
    groups: str = "239.255.0.0/16"
    port: int = 7100
    interface_address: str = ""  # "" = the data address
    loop: bool = True  # also deliver results to workers on the appliance's own host


@dataclass(frozen=True)
class JobDefaults:
    slots: int = 32  # slot pairs per core per job: the worker's window on that core
    idle_timeout_s: float = 600.0
    deadline_s: float = 60.0  # advised to workers: an allreduce unfinished by then fails


@dataclass(frozen=True)
class ApiConfig:
    listen: str = "127.0.0.1:7070"  # TCP, for workers; "" = no TCP API
    unix_socket: str = "/run/reduction-appliance/api.sock"  # for reductionctl; "" = none
    token_file: str = ""  # bearer token required on TCP; "" = no authentication (labs only)


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = ""  # HOST:PORT of the Prometheus endpoint; "" = /metrics on the API only


@dataclass(frozen=True)
class ApplianceConfig:
    dataplane: DataplaneConfig = field(default_factory=DataplaneConfig)
    multicast: MulticastConfig = field(default_factory=MulticastConfig)
    jobs: JobDefaults = field(default_factory=JobDefaults)
    api: ApiConfig = field(default_factory=ApiConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
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
        if key not in ("dataplane", "multicast", "jobs", "api", "metrics"):
            raise ConfigError(
                f"{key}: unknown section (known: api, dataplane, jobs, metrics, multicast)")
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
    _check(dp["slot_memory_mb"] >= 1, "dataplane.slot_memory_mb", "must be >= 1")
    _check(0 <= dp["dscp"] <= 63, "dataplane.dscp", "must be 0..63")
    _check(dp["rx_buffers"] >= 16, "dataplane.rx_buffers", "must be >= 16")
    _ip(dp["address"], "dataplane.address")
    dataplane = DataplaneConfig(**dp)
    payload = dataplane.max_payload
    fits = min(dataplane.mtu - _IP_UDP_HEADERS, _MAX_UDP_PAYLOAD) - HEADER_SIZE
    _check(64 <= payload <= fits and payload % 64 == 0, "dataplane.segment_bytes",
           f"must be a multiple of 64 between 64 and {fits} (what MTU {dataplane.mtu} carries)")
    _check(dataplane.slot_capacity >= 1, "dataplane.slot_memory_mb",
           f"holds no slot pair of {dataplane.slot_pair_bytes} bytes")

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
    _check(jobs.deadline_s > 0, "jobs.deadline_s", "must be > 0")

    api = ApiConfig(**_section(raw, "api", ApiConfig))
    if api.listen:
        _host_port(api.listen, "api.listen")
    _check(bool(api.listen or api.unix_socket), "api", "needs listen or unix_socket")
    if api.token_file:
        _check(bool(api.listen), "api.token_file", "protects the TCP API; set api.listen")
    metrics = MetricsConfig(**_section(raw, "metrics", MetricsConfig))
    if metrics.listen:
        _host_port(metrics.listen, "metrics.listen")
    return ApplianceConfig(dataplane, mc, jobs, api, metrics, source)


def split_host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def _host_port(value: str, key: str) -> None:
    host, sep, port = value.rpartition(":")
    _check(bool(sep) and port.isdigit() and 0 <= int(port) <= 65535, key,
           f"expected HOST:PORT, got {value!r}")
    _ip(host, key)


def read_token(cfg: ApplianceConfig) -> str | None:
    """The API token, or None when the TCP API is unauthenticated."""
    if not cfg.api.token_file:
        return None
    try:
        token = Path(cfg.api.token_file).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"api.token_file: cannot read {cfg.api.token_file}: "
                          f"{exc.strerror}") from exc
    if len(token) < 16:
        raise ConfigError(f"api.token_file: {cfg.api.token_file} holds fewer than 16 "
                          "characters; use a long random token")
    return token


def _ip(value: str, key: str) -> None:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not an IPv4 address") from None
