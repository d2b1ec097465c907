"""`reductiond`: load the config, check and steer the data interface, start the data plane,
serve the API (TCP for workers, a Unix socket for reductionctl, optionally a metrics port),
evict idle jobs, and on SIGTERM drain, tell every job's workers, and release everything.

Under systemd (Type=notify) it says READY=1 once it serves, STOPPING=1 when it starts to shut
down, and WATCHDOG=1 from its periodic loop while the API's event loop still answers: a
daemon whose loop or API is wedged is restarted by systemd instead of lingering.

SIGTERM, in order: stop accepting API connections and close idle ones (the TCP ports stay
bound until the jobs' workers are told, so that none takes a refused connection for a dead
daemon); wait up to api.drain_s for requests in flight; let every job finish the rounds it has
begun and begin no later one, then tell its workers (control.drain: about a second for a busy
job, at most 5 s); stop the cores; remove the steering rules. Whatever clients hold open, the
daemon is gone within about api.drain_s + 5 s + the cores' own stop.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from reduction_appliance.dataplane.errors import ReductionError, Unavailable

from . import steering
from .api import build_server
from .config import ApplianceConfig, load, read_token
from .fallbacks import Fallbacks
from .hostfit import host_verdicts
from .registry import Registry
from .service import Appliance
from .snapshot import InterfaceSnapshot
from .supervisor import Supervisor

__all__ = ["DRAIN_GRACE_S", "Janitor", "main", "raise_open_files_limit", "sd_notify", "serve"]

_log = logging.getLogger("reductiond")
_JANITOR_EVERY_S = 1.0
#: Longest wait for the rounds begun to finish on SIGTERM (after the API's api.drain_s).
DRAIN_GRACE_S = 5.0


def sd_notify(message: str) -> bool:
    """Tell systemd `message` ("READY=1", ...) on $NOTIFY_SOCKET (a path, or "@name" for an
    abstract socket); False when not run under a notifying service manager or it failed."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        _log.warning("sd_notify %s to %s failed: %s", message.split("\n")[0],
                     os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def _watchdog_interval_s() -> float | None:
    """Half the watchdog timeout systemd set for us, or None when it set none."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


def raise_open_files_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (every API connection is a file
    descriptor) and return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    _log.info("open files limit %d (was %d)", now, soft)
    return now


class Janitor:
    """The periodic chores (receive rates, a health probe of every core, idle-job eviction).
    They must never kill the daemon: a failure is logged in one line, counted (`status` shows
    the count), and the next tick tries again. `Unavailable` (a core restarting, or a stalled
    one the probe just had killed for a restart) is not a failure: it passes."""

    def __init__(self, appliance: Appliance, count: Callable[[], None]) -> None:
        self.appliance = appliance
        self._count = count

    def tick(self) -> None:
        for what, chore in (("sampling rates", self.appliance.sample_rates),
                            ("probing the cores", self.appliance.probe_cores),
                            ("evicting idle jobs", self._evict)):
            try:
                chore()
            except Unavailable as exc:
                _log.debug("janitor: %s skipped: %s", what, exc)
            except Exception as exc:
                self._count()
                where = traceback.extract_tb(exc.__traceback__)[-1]
                _log.error("janitor: %s failed: %s: %s (at %s:%s in %s)", what,
                           type(exc).__name__, exc, Path(where.filename).name, where.lineno,
                           where.name)

    def _evict(self) -> None:
        for gone in self.appliance.evict_idle():
            _log.info("evicted job %d (%s): %s", gone.plan.spec.job_id, gone.plan.name,
                      gone.reason)


@contextlib.contextmanager
def _steered(cfg: ApplianceConfig) -> Iterator[steering.SteeringPlan | None]:
    """Check the data interface and hold its rules for the daemon's life (none when no
    interface is configured: a lab or loopback run)."""
    ifname = cfg.dataplane.interface
    if not ifname:
        yield None
        return
    needed = steering.SteeringInputs.from_config(cfg, rx_queues=1).mtu_needed
    state = steering.check_interface(ifname, needed)
    the_plan = steering.plan(steering.SteeringInputs.from_config(cfg, state.rx_queues))
    with steering.Steering(the_plan):
        yield the_plan


def _multicast_usable(cfg: ApplianceConfig, fallbacks: Fallbacks) -> bool:
    """Whether jobs may have their results multicast: configured so, and routable here."""
    if not cfg.multicast.enabled:
        return False
    mc = cfg.multicast
    unroutable = steering.multicast_unroutable(  # the cores' sockets: see Supervisor.core_configs
        cfg.dataplane.address, mc.interface_address or cfg.dataplane.address, mc.groups)
    if unroutable is not None:
        fallbacks.note(f"results by unicast fan-out to each rank, not multicast: {unroutable}")
        return False
    return True


def serve(cfg: ApplianceConfig, stop: threading.Event) -> None:
    """Run until `stop` is set. Prints one `reductiond ready` line when serving."""
    token = read_token(cfg)
    with contextlib.ExitStack() as stack:
        the_plan = stack.enter_context(_steered(cfg))
        fallbacks = Fallbacks()
        multicast = _multicast_usable(cfg, fallbacks)  # after steering: it may add the route
        supervisor = stack.enter_context(Supervisor(cfg, fallbacks=fallbacks))

        def network_view() -> tuple[tuple[InterfaceSnapshot, ...], tuple[str, ...],
                                    tuple[str, ...], tuple[str, ...]]:
            if the_plan is None:
                return (), (), ("no data interface configured: nothing steered",), \
                    tuple(steering.rdma_devices())
            ifname = the_plan.ifname
            return (tuple(steering.interfaces_snapshot([ifname])),
                    tuple(steering.current(ifname, cfg.multicast.groups)), the_plan.notes,
                    tuple(steering.rdma_devices()))

        appliance = Appliance(Registry(cfg, multicast=multicast), supervisor,
                              network_view=network_view)
        supervisor.on_restart = appliance.core_restarted
        server, where = build_server(cfg, appliance, token)
        appliance.api_abandoned = lambda: server.abandoned
        stack.callback(server.stop)  # on an error; the normal path stops it first, below
        server.start()
        dp = cfg.dataplane
        ready = (f"reductiond ready: {', '.join(where)}; {dp.cores} core(s) on "
                 f"{dp.address}:{dp.base_port}, segment {dp.max_payload} B, reduce kernels "
                 f"{'/'.join(sorted({c.kernels for c in supervisor.cores}))}")
        print(ready, flush=True)
        sd_notify(f"READY=1\nSTATUS={ready}\nMAINPID={os.getpid()}")

        def count() -> None:
            appliance.janitor_errors += 1

        janitor = Janitor(appliance, count)
        watchdog_s = _watchdog_interval_s()
        period = min(_JANITOR_EVERY_S, watchdog_s) if watchdog_s else _JANITOR_EVERY_S
        if watchdog_s:
            sd_notify("WATCHDOG=1")
        while not stop.wait(period):
            janitor.tick()
            if watchdog_s and server.responsive(timeout_s=min(1.0, watchdog_s)):
                sd_notify("WATCHDOG=1")
        sd_notify("STOPPING=1")
        started = time.monotonic()
        _log.info("stopping: %d API connection(s) open, draining up to %g s",
                  server.connections, cfg.api.drain_s)
        with server.tcp_ports_held():  # (until the jobs' workers are told: see its docstring)
            server.stop()
            appliance.shutdown(DRAIN_GRACE_S)
        _log.info("API and data plane drained in %.1f s; stopping the cores",
                  time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reductiond", description=__doc__)
    parser.add_argument("--config", "-c", required=True, help="appliance TOML file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(name)s %(levelname)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        # SIGHUP's default ends a process at once: a closed terminal, or a log rotation's
        # habitual `kill -HUP`, cut every job off without the drain SIGTERM gives.
        _log.warning("SIGHUP ignored: reductiond does not reload its config; restart it "
                     "(SIGTERM drains the jobs) to apply a new one")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    try:
        cfg = load(args.config)
        for crowded in host_verdicts(cfg):  # (raises where the cores cannot start here)
            _log.warning("%s", crowded)
        files = raise_open_files_limit()
        if files < cfg.api.max_connections + 64:
            _log.warning("open files limit %d is below api.max_connections %d plus the "
                         "daemon's own: raise LimitNOFILE", files, cfg.api.max_connections)
        serve(cfg, stop)
    except ReductionError as exc:
        _log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
