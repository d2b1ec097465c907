"""Run a real appliance and real worker processes on a network: the emulated rack or loopback.

Shared by the demo, the benchmarks and the integration tests, so that all of them exercise the
same `reductiond` and the same worker client the way an operator would: separate processes,
configuration from a TOML file, registration over the API, data over UDP.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pyroute2 import netns as namespaces

from reduction_appliance.control.apiclient import UnixApi
from reduction_appliance.control.config import (
    ApiConfig,
    ApplianceConfig,
    DataplaneConfig,
    HostPort,
    JobDefaults,
    MulticastConfig,
    parse,
    to_toml,
)

from .lab import Lab, remove_namespaces
from .output import OutputTail
from .topology import Host, Topology
from .unwind import unwinding_on_termination

__all__ = [
    "DAEMON",
    "WORKER",
    "ApplianceProcess",
    "HarnessError",
    "LabNetwork",
    "LoopbackNetwork",
    "Network",
    "OutputTail",
    "api_request",
    "appliance_config",
    "local_daemon",
    "run_workers",
    "start_appliance",
    "worker_argv",
]

#: `python` arguments that run reductiond and the lab's worker program.
DAEMON = ("-m", "reduction_appliance.control.daemon")
WORKER = ("-m", "reduction_appliance.deploy.testnet.worker")
_API_PORT = 7070
_READY_TIMEOUT_S = 60.0


class HarnessError(RuntimeError):
    """A process of the run failed; the message carries its stderr."""


class Network(Protocol):
    """Where the run's processes live."""

    multicast: bool  # can results be multicast here?

    @property
    def mtu(self) -> int: ...

    def appliance_address(self, index: int) -> str: ...
    def worker_address(self, rank: int) -> str: ...
    def worker_interface(self, rank: int) -> str:
        """The interface worker `rank` reaches the others on: Gloo must be told
        (GLOO_SOCKET_IFNAME), since the hostname resolves to loopback in a namespace."""
        ...

    def popen_appliance(
        self, index: int, argv: Sequence[str], **kw: Any
    ) -> subprocess.Popen[Any]: ...
    def popen_worker(self, rank: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]: ...


_REQUEST_JSON = (
    "import sys, urllib.request as u; "
    "o = u.build_opener(u.ProxyHandler({})); "
    "r = u.Request(sys.argv[2], method=sys.argv[1]); "
    "sys.stdout.write(o.open(r, timeout=10).read().decode())"
)


def api_request(net: Network, index: int, method: str, url: str) -> Any:
    """Send a bodiless request to appliance `index`'s API and return its JSON answer, from
    inside the appliance's own network namespace: lab addresses exist only there, so the
    harness never sends them into the host's network."""
    proc = net.popen_appliance(index, [sys.executable, "-c", _REQUEST_JSON, method, url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=30)
    if proc.returncode != 0:
        raise HarnessError(f"{method} {url} failed: {err.strip()[-1000:]}")
    return json.loads(out)


def _env() -> dict[str, str]:
    # The product is found through the interpreter's installation (pip install -e), the same
    # way an operator's processes find it.
    return dict(os.environ)


@dataclass
class LabNetwork:
    """The emulated rack: one namespace per host on a bridge, shaped links. With
    `ranks_per_host` k, ranks k*h .. k*h + k - 1 share host h's namespace and link (a server
    with k GPUs and one NIC)."""

    lab: Lab
    multicast: bool = True
    ranks_per_host: int = 1

    @property
    def mtu(self) -> int:
        return self.lab.topology.worker_link.mtu

    @property
    def workers(self) -> int:
        return len(self.lab.topology.workers) * self.ranks_per_host

    def _host(self, rank: int) -> Host:
        return self.lab.topology.workers[rank // self.ranks_per_host]

    def appliance_address(self, index: int) -> str:
        return self.lab.topology.appliances[index].address

    def worker_address(self, rank: int) -> str:
        return self._host(rank).address

    def worker_interface(self, rank: int) -> str:
        return self.lab.interface_of(self._host(rank).name)

    def popen_appliance(self, index: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        return self.lab.popen(self.lab.topology.appliances[index].name, argv, env=_env(), **kw)

    def popen_worker(self, rank: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        return self.lab.popen(self._host(rank).name, argv, env=_env(), **kw)

    @classmethod
    @contextlib.contextmanager
    def rack(cls, workers: int, multicast: bool = True, ranks_per_host: int = 1,
             **links: Any) -> Iterator[LabNetwork]:
        """A rack for `workers` ranks, `ranks_per_host` of them on each host."""
        if ranks_per_host < 1 or workers % ranks_per_host:
            raise ValueError(f"{workers} ranks do not fill hosts of {ranks_per_host}")
        with Lab(Topology.rack(workers=workers // ranks_per_host, **links)) as lab:
            yield cls(lab, multicast, ranks_per_host)


@dataclass
class LoopbackNetwork:
    """Everything on 127.0.0.1. As root, inside a private namespace whose loopback has
    multicast switched on (the host's own loopback is left alone); otherwise on the host's
    loopback with unicast results."""

    multicast: bool = False
    mtu: int = 65535
    netns: str | None = None
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def appliance_address(self, index: int) -> str:
        return "127.0.0.1"

    def worker_address(self, rank: int) -> str:
        return "127.0.0.1"

    def worker_interface(self, rank: int) -> str:
        return "lo"

    def _popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        kw.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen([*prefix, *argv], env=_env(), **kw)
        self._procs.append(proc)
        return proc

    def popen_appliance(self, index: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        return self._popen(argv, **kw)

    def popen_worker(self, rank: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        return self._popen(argv, **kw)

    @classmethod
    @contextlib.contextmanager
    def create(cls, multicast: bool = True) -> Iterator[LoopbackNetwork]:
        with unwinding_on_termination():  # SIGTERM and SIGHUP remove the namespace too
            yield from cls._create(multicast)

    @classmethod
    def _create(cls, multicast: bool) -> Iterator[LoopbackNetwork]:
        if os.geteuid() != 0 or not multicast:
            net = cls(multicast=False)
            try:
                yield net
            finally:
                _stop_all(net._procs)
            return
        remove_orphaned_loopback_namespaces()
        name = f"{_LOOPBACK_NS_PREFIX}{os.getpid()}"
        commands = [
            ["ip", "netns", "add", name],
            ["ip", "-n", name, "link", "set", "lo", "up"],
            ["ip", "-n", name, "link", "set", "lo", "multicast", "on"],
            ["ip", "-n", name, "route", "add", "239.255.0.0/16", "dev", "lo"],
        ]
        net = cls(multicast=True, netns=name)
        try:
            for command in commands:
                subprocess.run(command, check=True, capture_output=True)
            yield net
        finally:
            _stop_all(net._procs)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


_LOOPBACK_NS_PREFIX = "ra-lo-"  # + the pid of the process that made it


def remove_orphaned_loopback_namespaces() -> list[str]:
    """Remove loopback namespaces whose maker is gone. A run killed outright (SIGKILL, an OOM
    kill) cannot run its cleanup, and its namespace would stay for good; the next run removes
    it. Returns the names removed."""
    orphans = []
    for name in namespaces.listnetns():
        pid = name.removeprefix(_LOOPBACK_NS_PREFIX)
        if pid != name and pid.isdigit() and not _alive(int(pid)):
            orphans.append(name)
    return remove_namespaces(orphans)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _stop_all(procs: list[subprocess.Popen[Any]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class ApplianceProcess:
    process: subprocess.Popen[str]
    api: str  # host:port
    config_path: Path
    net: Network
    index: int
    unix_socket: str  # the API for tools on the appliance host (no network traffic)
    # the daemon's output, drained as it comes (its last 64 KiB each)
    stdout: OutputTail | None = None
    stderr: OutputTail | None = None

    @property
    def local_api(self) -> UnixApi:
        return UnixApi(self.unix_socket)

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.local_api.get("/v1/status")
        return result

    def delete_job(self, job_id: int) -> None:
        """Remove a finished job, freeing its slots (DELETE /v1/jobs/ID)."""
        self.local_api.request("DELETE", f"/v1/jobs/{job_id}")

    def jobs_named(self, name: str) -> list[dict[str, Any]]:
        """The registered jobs called `name` (normally one), as `GET /v1/jobs` shows them."""
        return [j for j in self.local_api.get("/v1/jobs") if j.get("name") == name]

    def job_ids(self, name: str) -> list[int]:
        return [int(j["job_id"]) for j in self.jobs_named(name)]

    def counters(self) -> dict[str, int]:
        """Counters summed over the data-plane cores."""
        total: dict[str, int] = {}
        for core in self.status()["cores"]:
            for key, value in core["counters"].items():
                total[key] = total.get(key, 0) + value
        return total


def appliance_config(address: str, *, cores: int, mtu: int, slots: int = 32,
                     multicast: bool = True, poll: str = "adaptive", spin_us: int = 200,
                     kernels: str = "auto", unix_socket: str = "", token_file: str = "",
                     interface: str = "", groups: str = "239.255.0.0/16",
                     liveness_s: float = 5.0,
                     queue_target_s: float = JobDefaults.queue_target_s,
                     deadline_s: float = JobDefaults.deadline_s) -> ApplianceConfig:
    """The lab appliance's configuration, as the typed tree reductiond will load."""
    # Pin data-plane core i to CPU i when the machine has that many: the appliance's layout.
    cpus = tuple(range(cores)) if cores <= (os.cpu_count() or 1) else ()
    return ApplianceConfig(
        dataplane=DataplaneConfig(address=address, cores=cores, cpus=cpus, mtu=mtu,
                                  poll=poll, spin_us=spin_us,  # type: ignore[arg-type]
                                  kernels=kernels, slot_memory_mb=256, rx_buffers=1024,
                                  interface=interface),
        multicast=MulticastConfig(enabled=multicast, groups=ipaddress.IPv4Network(groups)),
        jobs=JobDefaults(slots=slots, liveness_timeout_s=liveness_s,
                         queue_target_s=queue_target_s, deadline_s=deadline_s),
        api=ApiConfig(listen=HostPort(address, _API_PORT), unix_socket=unix_socket,
                      token_file=token_file),
    )


@contextlib.contextmanager
def start_appliance(net: Network, index: int = 0, *, cores: int = 2, slots: int = 32,
                    poll: str = "adaptive", kernels: str = "auto", spin_us: int = 200,
                    multicast: bool | None = None, token: str | None = None,
                    interface: str = "", groups: str = "239.255.0.0/16",
                    liveness_s: float = 5.0,
                    queue_target_s: float = JobDefaults.queue_target_s,
                    deadline_s: float = JobDefaults.deadline_s,
                    mtu: int | None = None,
                    ) -> Iterator[ApplianceProcess]:
    """Run `reductiond` on appliance `index` until the block ends (then SIGTERM, then kill).
    `multicast` overrides the network's default (False: results by unicast fan-out only);
    `token` makes the TCP API require it; `liveness_s` is the jobs' liveness timeout;
    `queue_target_s` the workers' advised congestion target (0: fixed windows); `deadline_s`
    the workers' advised deadline; `mtu` the appliance's `dataplane.mtu` (None: the network's,
    as an operator sets it for the rack's links)."""
    address = net.appliance_address(index)
    # SIGTERM and SIGHUP stop the daemon too (it would outlive this process, cores and all).
    with unwinding_on_termination(), tempfile.TemporaryDirectory(prefix="reductiond-") as tmp:
        path = Path(tmp) / "appliance.toml"
        token_file = ""
        if token is not None:
            token_file = str(Path(tmp) / "token")
            Path(token_file).write_text(token)
        unix_socket = str(Path(tmp) / "api.sock")
        mc = net.multicast if multicast is None else multicast
        cfg = appliance_config(address, cores=cores, mtu=net.mtu if mtu is None else mtu,
                               slots=slots, multicast=mc,
                               poll=poll, spin_us=spin_us, kernels=kernels,
                               unix_socket=unix_socket, token_file=token_file,
                               interface=interface, groups=groups, liveness_s=liveness_s,
                               queue_target_s=queue_target_s, deadline_s=deadline_s)
        path.write_text(to_toml(cfg))
        proc = net.popen_appliance(
            index, [sys.executable, *DAEMON, "--config", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        out = OutputTail(proc.stdout, marker="reductiond ready")
        err = OutputTail(proc.stderr)
        try:
            _await_ready(proc, out, err)
            yield ApplianceProcess(proc, f"{address}:{_API_PORT}", path, net, index,
                                   unix_socket, out, err)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@dataclass
class LocalDaemon:
    process: subprocess.Popen[str]
    api: str  # host:port of its TCP API
    unix_socket: str
    stderr: OutputTail


@contextlib.contextmanager
def local_daemon(raw: dict[str, Any], ready_s: float = _READY_TIMEOUT_S
                 ) -> Iterator[LocalDaemon]:
    """`reductiond` on this host's own network, configured by `raw` (the TOML tree; its API on
    TCP, a Unix socket of its own added), in a process group of its own, until the block ends
    (then SIGKILL to the group: its cores too)."""
    with unwinding_on_termination(), \
            tempfile.TemporaryDirectory(prefix="rd-") as tmp:  # short: a socket path has 108 B
        sock = str(Path(tmp) / "api.sock")
        cfg = parse({**raw, "api": {**raw.get("api", {}), "unix_socket": sock}})
        path = Path(tmp) / "appliance.toml"
        path.write_text(to_toml(cfg))
        proc = subprocess.Popen([sys.executable, *DAEMON, "--config", str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        out, err = OutputTail(proc.stdout, marker="reductiond ready"), OutputTail(proc.stderr)
        try:
            _await_ready(proc, out, err, ready_s)
            found = re.search(r"api ([\d.]+):(\d+)", out.line or "")
            if found is None:
                raise HarnessError(f"reductiond serves no TCP API: {out.line}")
            yield LocalDaemon(proc, f"{found.group(1)}:{found.group(2)}", sock, err)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _await_ready(proc: subprocess.Popen[str], out: OutputTail, err: OutputTail,
                 ready_s: float = _READY_TIMEOUT_S) -> None:
    """Until reductiond prints its ready line; a daemon that exits first fails with its
    stderr's tail."""
    if out.seen.wait(ready_s) and out.line:
        return
    if proc.poll() is not None or out.done:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        err.join()
        raise HarnessError(f"reductiond exited with {proc.returncode}: {err.text().strip()}")
    raise HarnessError(f"reductiond not ready within {ready_s:g} s: "
                       f"{err.text().strip()[-2000:]}")


def run_workers(net: Network, argv_of_rank: Sequence[Sequence[str]],
                timeout_s: float = 600.0) -> list[list[dict[str, Any]]]:
    """Run one worker process per rank to completion; return each one's JSON lines.
    A worker that fails or outlives `timeout_s` fails the run with its stderr."""
    procs = [
        net.popen_worker(rank, [sys.executable, *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for rank, argv in enumerate(argv_of_rank)
    ]
    deadline = time.monotonic() + timeout_s
    outputs: list[list[dict[str, Any]]] = []
    failures: list[str] = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"rank {rank} still running after {timeout_s:g} s: {err[-2000:]}")
            continue
        if proc.returncode != 0:
            failures.append(f"rank {rank} exited {proc.returncode}: {err.strip()[-2000:]}")
        outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    if failures:
        raise HarnessError("; ".join(failures))
    return outputs


def worker_argv(net: Network, api: str, world: int, job: str,
                options: Sequence[str] = (), secret: str | None = None) -> list[list[str]]:
    """The lab worker program's command lines for every rank of a job on `net`, sharing one
    join secret (a fresh one unless given)."""
    secret = secret or secrets.token_urlsafe(16)
    return [
        [*WORKER, "--appliance", api, "--job", job, "--world", str(world), f"--secret={secret}",
         "--rank", str(rank), "--local", net.worker_address(rank), *options]
        for rank in range(world)
    ]
