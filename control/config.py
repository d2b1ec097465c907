"""The appliance configuration: one frozen, typed tree, loaded once from TOML.

Every rejection names the key and why, so `reductionctl check-config` and a failing
`reductiond` start say exactly what to fix. Unknown keys are errors too: a typo must not silently
fall back to a default. Values that need parsing (networks, HOST:PORT pairs) are kept parsed in
the tree (a field whose metadata has "parse" is a string in the file, `parse(text, key)` in the
tree), so nothing downstream parses or validates them again; `to_toml` writes a tree back
out (the labs configure their appliances that way, never with a second copy of the schema).
"""

from __future__ import annotations

import ipaddress
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

from reduction_appliance.control.pathmtu import data_path_mtu
from reduction_appliance.dataplane.errors import ConfigError
from reduction_appliance.dataplane.spec import KERNEL_BACKENDS
from reduction_appliance.dataplane.wire import HEADER_SIZE, IP_UDP_HEADERS

__all__ = ["KERNEL_CHOICES", "ApiConfig", "ApplianceConfig", "DataplaneConfig", "HostPort",
           "JobDefaults", "MetricsConfig", "MulticastConfig", "load", "parse", "read_token",
           "to_toml"]

_MAX_UDP_PAYLOAD = 65507
KERNEL_CHOICES = ("auto", *KERNEL_BACKENDS)


class HostPort(NamedTuple):
    """A listen address, parsed from "HOST:PORT"."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def _ip(value: str, key: str) -> str:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not an IPv4 address") from None
    return value


def _host_port(value: str, key: str) -> HostPort | None:
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    if not (sep and port.isdigit() and 0 <= int(port) <= 65535):
        raise ConfigError(f"{key}: expected HOST:PORT, got {value!r}")
    return HostPort(_ip(host, key), int(port))


def _network(value: str, key: str) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


@dataclass(frozen=True)
class DataplaneConfig:
    address: str = "127.0.0.1"  # data address the cores bind to
    base_port: int = 7000  # core i listens on base_port + i
    cores: int = 1  # data-plane processes
    cpus: tuple[int, ...] = ()  # CPU each core is pinned to; () = unpinned
    poll: Literal["busy", "adaptive"] = "adaptive"
    spin_us: int = 200
    # Of the data path; sizes segments so datagrams never fragment. 0 = the data interface's
    # own (control/pathmtu.py), read when the file is parsed: jumbo frames give 8.9 KB
    # segments, loopback 64 KB.
    mtu: int = 0
    segment_bytes: int = 0  # 0 = the largest that fits the MTU
    slot_memory_mb: int = 64  # per core: accumulators and results of every admitted job
    rx_buffers: int = 512
    kernels: str = "auto"  # one of KERNEL_CHOICES
    interface: str = ""  # data interface: checked and steered when set (see steering.py)
    dscp: int = 26  # DSCP class marked on data-plane datagrams (AF31)
    # How long a core may take to start (it imports numpy, maybe torch) and to answer a
    # request before it counts as failed or stalled: raise both on an emulated machine.
    core_start_timeout_s: float = 30.0
    core_reply_timeout_s: float = 10.0
    # Where `mtu` came from ("" = the file or the caller): derived, never read from a file.
    mtu_from: str = field(default="", metadata={"derived": True})

    @property
    def segment_origin(self) -> str:
        """How the segment size was chosen, for check-config and status."""
        if self.segment_bytes:
            return "dataplane.segment_bytes"
        return f"MTU {self.mtu} of {self.mtu_from}" if self.mtu_from else f"MTU {self.mtu}"

    @property
    def max_payload(self) -> int:
        if self.segment_bytes:
            return self.segment_bytes
        fit = min(self.mtu - IP_UDP_HEADERS, _MAX_UDP_PAYLOAD) - HEADER_SIZE
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
    groups: ipaddress.IPv4Network = field(
        default=ipaddress.IPv4Network("239.255.0.0/16"), metadata={"parse": _network})
    port: int = 7100
    interface_address: str = ""  # "" = the data address
    loop: bool = True  # also deliver results to workers on the appliance's own host


@dataclass(frozen=True)
class JobDefaults:
    slots: int = 32  # slot pairs per core per job: the worker's window on that core
    idle_timeout_s: float = 600.0
    deadline_s: float = 60.0  # advised to workers: an allreduce without a result that long fails
    # a rank (or the appliance) silent this long is declared dead; workers heartbeat well
    # within it, so a slow but live rank never is
    liveness_timeout_s: float = 5.0
    # advised to workers: a round trip longer than this, taken by the rank whose contribution
    # completed the segment, means a queue stands on the path, and every worker's window on
    # that core shrinks until it drains (plugin/congestion.py); 0 = fixed windows of `slots`
    queue_target_s: float = 0.025
    # receive buffers per core a deterministic job may hold (early ranks' contributions
    # waiting for their turn), reserved at admission so that no job can starve another
    hold_buffers: int = 128


@dataclass(frozen=True)
class ApiConfig:
    # TCP, for workers; None ("" in the file) = no TCP API
    listen: HostPort | None = field(default=HostPort("127.0.0.1", 7070),
                                    metadata={"parse": _host_port})
    unix_socket: str = "/run/reduction-appliance/api.sock"  # for reductionctl; "" = none
    token_file: str = ""  # bearer token required on TCP; "" = no authentication (labs only)
    # Open connections, all listeners; beyond: 503 and close. Four times a job of 4096 ranks
    # (the most admitted), each rank joining on its own: at 4096, four thousand ranks joining
    # at once met 503s, retried all together, and most never joined.
    max_connections: int = 16384
    handler_threads: int = 8  # requests served at once (they wait on the cores)
    max_body_bytes: int = 65536  # a larger request body gets 413
    header_timeout_s: float = 10.0  # for a request line and headers to arrive
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request is closed
    drain_s: float = 5.0  # on SIGTERM: longest wait for requests in flight


@dataclass(frozen=True)
class MetricsConfig:
    # The Prometheus endpoint; None ("" in the file) = /metrics on the API only
    listen: HostPort | None = field(default=None, metadata={"parse": _host_port})


@dataclass(frozen=True)
class RoceConfig:
    """RC queue pairs beside UDP (docs/roce.md). A job asks for RoCE when it is created."""

    device: str = ""  # RDMA device the cores use (`rdma link`); "" = no RoCE
    port: int = 1
    gid_index: int = 1  # the RoCE v2 GID of the data address (rxe: 1)
    segment_bytes: int = 262144  # per RoCE message: the NIC cuts it into MTU packets
    send_depth: int = 64  # send work requests in flight per queue pair
    queue_pairs: int = 64  # connections per core (a worker of a RoCE job holds one per core)

    @property
    def enabled(self) -> bool:
        return bool(self.device)


@dataclass(frozen=True)
class ApplianceConfig:
    dataplane: DataplaneConfig = field(default_factory=DataplaneConfig)
    multicast: MulticastConfig = field(default_factory=MulticastConfig)
    jobs: JobDefaults = field(default_factory=JobDefaults)
    api: ApiConfig = field(default_factory=ApiConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    roce: RoceConfig = field(default_factory=RoceConfig)
    source: str = "<defaults>"

    @property
    def arena_payload(self) -> int:
        """The largest segment of any job: what every slot of a core's arena holds."""
        roce = self.roce.segment_bytes if self.roce.enabled else 0
        return max(self.dataplane.max_payload, roce)

    @property
    def slot_pair_bytes(self) -> int:
        return 2 * 3 * self.arena_payload

    @property
    def slot_capacity(self) -> int:
        """Slot pairs per core that fit the slot memory budget."""
        return self.dataplane.slot_memory_mb * 2**20 // self.slot_pair_bytes


_SECTIONS = ("dataplane", "multicast", "jobs", "api", "metrics", "roce")


def load(path: str | Path) -> ApplianceConfig:
    """The file's configuration; every `ConfigError` starts with the file's path."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8: a binary or mis-encoded file
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return parse(raw, source=str(path))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _section(raw: dict[str, Any], name: str, cls: type[Any]) -> dict[str, Any]:
    section = raw.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = {f.name: f for f in fields(cls) if not f.metadata.get("derived")}
    for key in section:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
    defaults = cls()
    values: dict[str, Any] = {}
    for key, spec in known.items():
        default = getattr(defaults, key)
        if key not in section:
            values[key] = default
            continue
        value = section[key]
        parse = spec.metadata.get("parse")
        if parse is not None:
            ok = isinstance(value, str)
        elif isinstance(default, bool):
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
            wanted = "str" if parse is not None else type(default).__name__
            raise ConfigError(f"{name}.{key}: expected {wanted}, got {value!r}")
        values[key] = parse(value, f"{name}.{key}") if parse is not None else value
    return values


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def parse(raw: dict[str, Any], source: str = "<memory>") -> ApplianceConfig:
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(sorted(_SECTIONS))})")
    dp = _section(raw, "dataplane", DataplaneConfig)
    cpus = dp["cpus"]
    _check(1 <= dp["cores"] <= 64, "dataplane.cores", "must be 1..64")
    _check(not cpus or len(cpus) == dp["cores"], "dataplane.cpus",
           f"lists one CPU per core ({dp['cores']}) or is empty (unpinned)")
    for cpu in cpus:
        _check(isinstance(cpu, int) and not isinstance(cpu, bool) and cpu >= 0,
               "dataplane.cpus", f"entries are CPU numbers >= 0, got {cpu!r}")
    dp["cpus"] = tuple(cast(int, c) for c in cpus)
    _check(len(set(dp["cpus"])) == len(dp["cpus"]), "dataplane.cpus",
           f"lists a CPU twice ({list(dp['cpus'])}): each core polls a CPU of its own")
    _check(dp["poll"] in ("busy", "adaptive"), "dataplane.poll", "must be busy or adaptive")
    _check(dp["kernels"] in KERNEL_CHOICES, "dataplane.kernels",
           f"must be one of {', '.join(KERNEL_CHOICES)}, got {dp['kernels']!r}")
    _check(1 <= dp["base_port"] <= 65535 - dp["cores"], "dataplane.base_port", "out of range")
    _check(dp["mtu"] == 0 or 576 <= dp["mtu"] <= 65536, "dataplane.mtu",
           "must be 576..65536 (loopback's), or 0 for the data interface's own")
    _check(dp["spin_us"] >= 0, "dataplane.spin_us", "must be >= 0")
    _check(dp["slot_memory_mb"] >= 1, "dataplane.slot_memory_mb", "must be >= 1")
    _check(0 <= dp["dscp"] <= 63, "dataplane.dscp", "must be 0..63")
    _check(dp["rx_buffers"] >= 16, "dataplane.rx_buffers", "must be >= 16")
    _ip(dp["address"], "dataplane.address")
    if dp["mtu"] == 0:
        dp["mtu"], dp["mtu_from"] = data_path_mtu(dp["address"], dp["interface"])
    dataplane = DataplaneConfig(**dp)
    payload = dataplane.max_payload
    fits = min(dataplane.mtu - IP_UDP_HEADERS, _MAX_UDP_PAYLOAD) - HEADER_SIZE
    _check(64 <= payload <= fits and payload % 64 == 0, "dataplane.segment_bytes",
           f"must be a multiple of 64 between 64 and {fits} (what MTU {dataplane.mtu} carries)")
    for key in ("core_start_timeout_s", "core_reply_timeout_s"):
        _check(0 < getattr(dataplane, key) <= 3600, f"dataplane.{key}", "must be > 0 and <= 3600")
    _check(dataplane.slot_capacity >= 1, "dataplane.slot_memory_mb",
           f"holds no slot pair of {dataplane.slot_pair_bytes} bytes")

    mc = MulticastConfig(**_section(raw, "multicast", MulticastConfig))
    _check(mc.groups.is_multicast, "multicast.groups", f"{mc.groups} is not a multicast range")
    _check(mc.groups.num_addresses >= 2, "multicast.groups",
           "needs at least 2 addresses (the range's first is never handed out)")
    _check(1 <= mc.port <= 65535, "multicast.port", "out of range")
    if mc.interface_address:
        _ip(mc.interface_address, "multicast.interface_address")

    roce = RoceConfig(**_section(raw, "roce", RoceConfig))
    _check(1 <= roce.port <= 255, "roce.port", "must be 1..255")
    _check(0 <= roce.gid_index <= 255, "roce.gid_index", "must be 0..255")
    _check(4096 <= roce.segment_bytes <= 16 << 20 and roce.segment_bytes % 64 == 0,
           "roce.segment_bytes", "must be a multiple of 64 between 4 KiB and 16 MiB")
    _check(16 <= roce.send_depth <= 4096, "roce.send_depth", "must be 16..4096")
    _check(1 <= roce.queue_pairs <= 1023, "roce.queue_pairs", "must be 1..1023")
    payload = max(dataplane.max_payload, roce.segment_bytes if roce.enabled else 0)
    capacity = dataplane.slot_memory_mb * 2**20 // (6 * payload)
    _check(capacity >= 1, "dataplane.slot_memory_mb",
           f"holds no slot pair of {6 * payload} bytes (roce.segment_bytes {roce.segment_bytes})")

    jobs = JobDefaults(**_section(raw, "jobs", JobDefaults))
    _check(1 <= jobs.slots <= capacity, "jobs.slots",
           f"must be between 1 and the {capacity} slot pairs dataplane.slot_memory_mb holds")
    _check(jobs.idle_timeout_s > 0, "jobs.idle_timeout_s", "must be > 0")
    _check(jobs.deadline_s > 0, "jobs.deadline_s", "must be > 0")
    _check(0.5 <= jobs.liveness_timeout_s <= 3600, "jobs.liveness_timeout_s", "must be 0.5..3600")
    _check(0 <= jobs.queue_target_s <= 10, "jobs.queue_target_s", "must be 0..10 (0 = off)")
    from reduction_appliance.dataplane.slots import holdable_buffers  # numpy: parse only

    holdable = holdable_buffers(dataplane.rx_buffers)
    _check(1 <= jobs.hold_buffers <= holdable, "jobs.hold_buffers",
           f"must be between 1 and the {holdable} receive buffers deterministic jobs may hold "
           f"(dataplane.rx_buffers {dataplane.rx_buffers} less a burst's reserve)")

    api = ApiConfig(**_section(raw, "api", ApiConfig))
    _check(16 <= api.max_connections <= 1_000_000, "api.max_connections", "must be 16..1000000")
    _check(1 <= api.handler_threads <= 256, "api.handler_threads", "must be 1..256")
    _check(1024 <= api.max_body_bytes <= 16 << 20, "api.max_body_bytes", "must be 1 KiB..16 MiB")
    for key in ("header_timeout_s", "idle_timeout_s", "drain_s"):
        _check(0 < getattr(api, key) <= 3600, f"api.{key}", "must be > 0 and <= 3600")
    _check(bool(api.listen or api.unix_socket), "api", "needs listen or unix_socket")
    if api.token_file:
        _check(api.listen is not None, "api.token_file", "protects the TCP API; set api.listen")
    metrics = MetricsConfig(**_section(raw, "metrics", MetricsConfig))
    return ApplianceConfig(dataplane, mc, jobs, api, metrics, roce, source)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple) and not isinstance(value, HostPort):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None:
        return '""'
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def to_toml(cfg: ApplianceConfig) -> str:
    """The configuration as a TOML file that `parse` reads back to an equal tree."""
    lines: list[str] = []
    for name in _SECTIONS:
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        lines.extend(f"{f.name} = {_toml_value(getattr(section, f.name))}"
                     for f in fields(section) if not f.metadata.get("derived"))
        lines.append("")
    return "\n".join(lines)


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
