"""`reductiond`: load the config, start the data plane, serve the API until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from dataplane.errors import ReductionError

from .api import ApiServer, Appliance
from .config import ApplianceConfig, load
from .registry import Registry
from .supervisor import Supervisor

__all__ = ["main", "serve"]


def serve(cfg: ApplianceConfig, stop: threading.Event) -> None:
    """Run until `stop` is set. Prints one `ready` line (with the API address) when serving."""
    with Supervisor(cfg) as supervisor:
        host, _, port = cfg.api.listen.rpartition(":")
        server = ApiServer((host, int(port)), Appliance(Registry(cfg), supervisor))
        with server:
            thread = threading.Thread(target=server.serve_forever, name="api", daemon=True)
            thread.start()
            bound = server.server_address
            print(f"reductiond ready: api {bound[0]}:{bound[1]}, "
                  f"{cfg.dataplane.cores} core(s) on {cfg.dataplane.address}:"
                  f"{cfg.dataplane.base_port}, segment {cfg.dataplane.max_payload} B",
                  flush=True)
            stop.wait()
            server.shutdown()
            thread.join()


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
