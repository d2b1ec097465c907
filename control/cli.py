"""reductionctl: the operator's command line. Parsing and dispatch only.

    reductionctl status|jobs|abort|check-config|steering|clean ...   (control.ctl)
    reductionctl lab up|down|list ...                                 (deploy.testnet.cli)
    reductionctl bench ...                                            (bench.sweep)

Exit status: 0 done, 1 failed (the message says what), 2 bad usage.

`lab` and `bench` sit above the control plane (they start appliances and workers), so this
module never imports them: they are extensions named by module path, imported only when their
command runs. `reductionctl status` loads the control plane and nothing else.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from . import ctl

__all__ = ["EXTENSIONS", "main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: command -> (module whose main(argv) runs it, one-line help)
EXTENSIONS = {
    "lab": ("reduction_appliance.deploy.testnet.cli",
            "emulated racks on network namespaces (root); `lab --help` for more"),
    "bench": ("reduction_appliance.bench.sweep",
              "allreduce sweep: appliance vs Gloo ring on one network; `bench --help`"),
}


def _fail(message: str, status: int = EXIT_FAILED) -> int:
    print(f"reductionctl: {message}", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reductionctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(
        dest="command", required=True,
        metavar="{status,jobs,abort,check-config,steering,clean,lab,bench}")
    ctl.add_commands(sub)
    for name, (_, help_text) in EXTENSIONS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # dispatched before parsing
    return p


def _extension(name: str, argv: list[str]) -> int:
    module, _ = EXTENSIONS[name]
    run = importlib.import_module(module).main
    status: int = run(argv)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in EXTENSIONS:
            return _extension(argv[0], argv[1:])
        return ctl.run(_parser().parse_args(argv))
    except KeyboardInterrupt as exc:
        # SIGTERM or SIGHUP while a lab was up (deploy.testnet.unwind): torn down, as here.
        signum = getattr(exc, "signum", signal.SIGINT)
        return _fail("interrupted" if signum == signal.SIGINT else
                     f"stopped by {signal.Signals(signum).name}", 128 + signum)


if __name__ == "__main__":
    sys.exit(main())
