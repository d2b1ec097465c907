"""What the big-job benchmarks share (bench.heartbeats, bench.joins): `--ranks` parsed, the
configuration of a reductiond on loopback, and each job size measured under one progress bar,
framed by the machine's speed."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from reduction_appliance.control.registry import MOST_RANKS

from .gauge import framing, interpreter_ms
from .progress import ProgressBar

__all__ = ["each_size", "job_sizes", "loopback_daemon"]

T = TypeVar("T")


def job_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """`--ranks` ("64,1024"), each 1..MOST_RANKS; anything else is the parser's error."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"--ranks takes whole numbers, e.g. 64,1024: {text!r}")
    if not all(1 <= n <= MOST_RANKS for n in sizes):
        parser.error(f"--ranks are 1..{MOST_RANKS} (what the appliance admits)")
    return sizes


def loopback_daemon(cores: int, liveness_timeout_s: float) -> dict[str, Any]:
    """A reductiond's configuration on loopback (`harness.local_daemon`), on free ports."""
    return {
        "dataplane": {"address": "127.0.0.1", "base_port": _free_port(socket.SOCK_DGRAM),
                      "cores": cores, "cpus": [], "kernels": "numpy", "slot_memory_mb": 16},
        "multicast": {"enabled": False},
        "jobs": {"liveness_timeout_s": liveness_timeout_s},
        "api": {"listen": f"127.0.0.1:{_free_port(socket.SOCK_STREAM)}"},
    }


def _free_port(kind: socket.SocketKind) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def each_size(sizes: list[int], measure: Callable[[int, ProgressBar], T]) -> list[T]:
    """`measure(n, progress)` for each size, a progress bar over them, and the line that says
    how fast the machine ran Python before and after (printed)."""
    before = interpreter_ms()
    progress = ProgressBar(len(sizes))
    results = []
    for n in sizes:
        results.append(measure(n, progress))
        progress.advance()
    progress.close()
    print(framing(before, interpreter_ms()))
    return results
