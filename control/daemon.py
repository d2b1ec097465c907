"""`reductiond`: load the config, check and steer the data interface, start the data plane,
serve the API (TCP for workers, a Unix socket for reductionctl, optionally a metrics port),
evict idle jobs, and on SIGTERM drain, tell every job's workers, and release everything."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from socketserver import BaseServer
from types import FrameType

from reduction_appliance.dataplane.errors import ReductionError

from . import steering
from .api import ApiServer, MetricsServer, UnixApiServer
from .config import ApplianceConfig, load, read_token
from .registry import Registry
from .service import Appliance
from .snapshot import InterfaceSnapshot
from .supervisor import Supervisor

__all__ = ["main", "serve"]

_JANITOR_EVERY_S = 1.0
_DRAIN_GRACE_S = 5.0


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


@contextlib.contextmanager
def _serving(server: BaseServer, name: str) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def serve(cfg: ApplianceConfig, stop: threading.Event) -> None:
    """Run until `stop` is set. Prints one `ready` line when serving."""
    token = read_token(cfg)
    with contextlib.ExitStack() as stack:
        the_plan = stack.enter_context(_steered(cfg))
        supervisor = stack.enter_context(Supervisor(cfg))

        def network_view() -> tuple[tuple[InterfaceSnapshot, ...], tuple[str, ...],
                                    tuple[str, ...], tuple[str, ...]]:
            if the_plan is None:
                return (), (), ("no data interface configured: nothing steered",), \
                    tuple(steering.rdma_devices())
            ifname = the_plan.ifname
            return (tuple(steering.interfaces_snapshot([ifname])),
                    tuple(steering.current(ifname, cfg.multicast.groups)), the_plan.notes,
                    tuple(steering.rdma_devices()))

        appliance = Appliance(Registry(cfg), supervisor, network_view=network_view)
        supervisor.on_restart = appliance.core_restarted
        where = []
        if cfg.api.listen is not None:
            tcp = stack.enter_context(ApiServer(cfg.api.listen, appliance, token))
            stack.enter_context(_serving(tcp, "api"))
            where.append(f"api {cfg.api.listen}{' (token)' if token else ''}")
        if cfg.api.unix_socket:
            unix = stack.enter_context(UnixApiServer(cfg.api.unix_socket, appliance))
            stack.enter_context(_serving(unix, "api-unix"))
            where.append(f"unix {cfg.api.unix_socket}")
        if cfg.metrics.listen is not None:
            metrics = stack.enter_context(MetricsServer(cfg.metrics.listen, appliance))
            stack.enter_context(_serving(metrics, "metrics"))
            where.append(f"metrics {cfg.metrics.listen}")
        dp = cfg.dataplane
        print(f"reductiond ready: {', '.join(where)}; {dp.cores} core(s) on "
              f"{dp.address}:{dp.base_port}, segment {dp.max_payload} B", flush=True)
        while not stop.wait(_JANITOR_EVERY_S):
            appliance.sample_rates()
            with contextlib.suppress(ReductionError):
                for plan in appliance.evict_idle():
                    print(f"reductiond: evicted idle job {plan.spec.job_id} ({plan.name})",
                          flush=True)
        appliance.shutdown(_DRAIN_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reductiond", description=__doc__)
    parser.add_argument("--config", "-c", required=True, help="appliance TOML file")
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        serve(load(args.config), stop)
    except ReductionError as exc:
        print(f"reductiond: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
