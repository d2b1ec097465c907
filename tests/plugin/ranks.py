"""Run torch ranks (tests/plugin/torch_worker.py) on a test network, one process per rank."""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import Any

from reduction_appliance.deploy.testnet.harness import Network, run_workers

STORE_PORT_ON_RACK = 29500  # a fresh namespace: nothing else listens there

# What a rank in torch_worker.py's "backend" mode reports, (check, dtype, op) each.
BACKEND_CHECKS = {("allreduce", d, o) for d in ("fp32", "fp16", "bf16")
                  for o in ("sum", "avg", "min", "max")} | {
    (c, None, None) for c in ("layout", "async", "barrier", "broadcast", "delegated-int",
                              "strided", "transposed", "coalesced", "parameter", "scalar",
                              "subgroup", "empty", "overlapping", "cuda-delegated")}


def store_address(net: Network) -> str:
    """Where rank 0 serves the c10d store: worker 0's address, on a port free there."""
    host = net.worker_address(0)
    if host.startswith("127."):  # loopback: the host's own ports, so ask for a free one
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"
    return f"{host}:{STORE_PORT_ON_RACK}"


def torch_argv(net: Network, mode: str, world: int) -> list[list[str]]:
    store = store_address(net)
    return [["-m", "tests.plugin.torch_worker", mode, str(r), str(world), store,
             net.worker_address(r), net.worker_interface(r)] for r in range(world)]


def run_ranks(net: Network, mode: str, world: int,
              timeout_s: float = 120) -> list[list[dict[str, Any]]]:
    """Run every rank to completion; each rank's JSON records (a failed rank fails the run)."""
    return run_workers(net, torch_argv(net, mode, world), timeout_s=timeout_s)


def launch_ranks(net: Network, mode: str, world: int) -> list[subprocess.Popen[str]]:
    """Start every rank and return at once (the caller finishes them with `communicate`)."""
    return [net.popen_worker(r, [sys.executable, *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for r, argv in enumerate(torch_argv(net, mode, world))]
