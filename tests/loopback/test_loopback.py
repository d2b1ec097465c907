"""The appliance on loopback: runs everywhere (as root in a private namespace with multicast on
its loopback, otherwise on the host's loopback with unicast results)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from reduction_appliance.deploy.testnet.harness import (
    LoopbackNetwork,
    run_workers,
    start_appliance,
    worker_argv,
)

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each


_GARBAGE = """
import socket, struct, sys
from reduction_appliance.dataplane.wire import HEADER, MAGIC, VERSION

s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
port = int(sys.argv[1])
s.sendto(b"not ours", ("127.0.0.1", port))  # shorter than a header
s.sendto(b"\\x00" * 100, ("127.0.0.1", port))  # bad magic
bad_job = HEADER.pack(MAGIC, VERSION, 1, 1, 1, 0, 999, 0, 1, 5, 1, 0, 0, 4, 1) + bytes(4)
s.sendto(bad_job, ("127.0.0.1", port))  # a contribution for a job that does not exist
"""


def test_workers_reduce_exactly_on_loopback() -> None:
    with LoopbackNetwork.create() as net, start_appliance(net, cores=1) as appliance:
        argv = worker_argv(net, appliance.api, 3, "loop",
                           ["--sizes", "1KiB,3MiB", "--dtypes", "fp32,bf16", "--ops", "sum,max",
                            "--iters", "1"])
        outputs = run_workers(net, argv, timeout_s=120)
        assert [len(o) for o in outputs] == [8, 8, 8]
        assert all(c["ok"] and c["checked"] for o in outputs for c in o)


def test_garbage_datagrams_are_counted_and_dropped() -> None:
    with LoopbackNetwork.create() as net, start_appliance(net, cores=1) as appliance:
        sender = net.popen_worker(0, [sys.executable, "-c", _GARBAGE, "7000"],
                                  stderr=subprocess.PIPE, text=True)
        assert sender.wait(timeout=30) == 0, sender.stderr.read() if sender.stderr else ""
        outputs = run_workers(net, worker_argv(net, appliance.api, 2, "after-garbage",
                                               ["--sizes", "64KiB", "--iters", "1"]))
        assert all(c["ok"] for o in outputs for c in o)
        counters = appliance.counters()
    assert counters["drop_malformed"] == 2
    assert counters["drop_unknown_job"] == 1
