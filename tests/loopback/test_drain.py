"""A real reductiond stopped (SIGTERM: `systemctl stop`, a rolling upgrade) under a job whose
ranks call without pause: the calls begun finish on every rank, and every rank fails its next
call with JobAborted before any of that call's results reached its tensor. Once the daemon
let the busy job run for its whole grace and cut it off mid-call, some segments of each
rank's tensor summed and the rest its own input."""

from __future__ import annotations

import re
import signal
import socket
import threading

import numpy as np
import pytest

from reduction_appliance.client import ApplianceClient, register
from reduction_appliance.dataplane.errors import JobAborted, ReductionError
from reduction_appliance.deploy.testnet.harness import local_daemon
from tests.waiting import wait_until

from .test_eviction import _free_udp_ports

pytestmark = pytest.mark.slow  # a daemon with two cores: seconds

WORLD = 3
ELEMENTS = 1 << 17  # 512 KiB of fp32: segments on both cores


def test_a_stopped_appliance_finishes_the_calls_begun_and_cuts_none_in_half() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        api_port = s.getsockname()[1]
    cfg = {"dataplane": {"address": "127.0.0.1", "base_port": _free_udp_ports(2), "cores": 2,
                         "cpus": [], "kernels": "numpy", "slot_memory_mb": 8, "mtu": 9000},
           "multicast": {"enabled": False},
           "jobs": {"liveness_timeout_s": 60.0, "deadline_s": 120.0},
           "api": {"listen": f"127.0.0.1:{api_port}"}}
    calls = [0] * WORLD
    failures: list[ReductionError | None] = [None] * WORLD
    left: list[np.ndarray | None] = [None] * WORLD  # each rank's tensor after its failure
    with local_daemon(cfg) as daemon:
        info = register(daemon.api, "drained", world_size=WORLD, secret="secret-of-the-test")
        clients = [ApplianceClient([info], rank, local_address="127.0.0.1")
                   for rank in range(WORLD)]

        def reduce_until_it_fails(rank: int) -> None:
            total = WORLD * (WORLD + 1) / 2
            while True:
                x = np.arange(ELEMENTS, dtype=np.float32) + (rank + 1)
                try:
                    clients[rank].allreduce(x)
                except ReductionError as exc:
                    failures[rank], left[rank] = exc, x
                    return
                assert np.array_equal(x, WORLD * np.arange(ELEMENTS, dtype=np.float32) + total)
                calls[rank] += 1

        threads = [threading.Thread(target=reduce_until_it_fails, args=(r,))
                   for r in range(WORLD)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: min(calls) >= 3, 60, what="three exact calls on each rank")
            daemon.process.send_signal(signal.SIGTERM)
            assert daemon.process.wait(timeout=60) == 0
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), failures
        finally:
            for client in clients:
                client.close()
    assert len(set(calls)) == 1, calls  # every rank finished the same calls
    for rank, failure in enumerate(failures):
        assert type(failure) is JobAborted, failure
        found = re.search(r"\(the appliance is shutting down: it let every round up to (\d+) "
                          r"finish, and no later one begin\) during allreduce round (\d+) ",
                          str(failure))
        assert found, failure
        assert (int(found[1]), int(found[2])) == (calls[rank], calls[rank] + 1), failure
        assert str(failure).endswith("none of its results had come, so the appliance wrote "
                                     "nothing into the array it was given")
        x = left[rank]
        assert x is not None
        assert np.array_equal(x, np.arange(ELEMENTS, dtype=np.float32) + (rank + 1))
