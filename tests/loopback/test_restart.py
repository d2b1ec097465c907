"""A real reductiond killed under a running job, and started again on the same ports (a crash,
then systemd's restart). Killed while the workers reduce: their API connection refused, they
fail with ApplianceEnded about a second later (plugin.silence). Killed and restarted while they
are idle: the restarted appliance's cores tell them the job is gone, at their next call, and
they fail with JobAborted saying so. Either way they once waited out their liveness timeout
(or, idle meanwhile, a whole timeout more from their next call) and said only that the
appliance had gone silent."""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

import numpy as np
import pytest

from reduction_appliance.client import ApplianceClient, register
from reduction_appliance.dataplane.errors import ApplianceEnded, JobAborted, ReductionError
from reduction_appliance.deploy.testnet.harness import local_daemon
from tests.waiting import wait_until

from .ranks import allreduce_once_on_every_rank
from .test_eviction import _free_udp_ports

pytestmark = pytest.mark.slow  # two daemons, one after the other: seconds

# Longer than the test could take: a worker that failed with anything but what the restarted
# cores said would have waited for it (ApplianceSilent), or for its deadline.
LIVENESS_S = 60.0


def _config() -> dict[str, Any]:
    with socket.socket() as s:  # the API's port, the same for both daemons
        s.bind(("127.0.0.1", 0))
        api_port = s.getsockname()[1]
    return {
        "dataplane": {"address": "127.0.0.1", "base_port": _free_udp_ports(1), "cores": 1,
                      "cpus": [], "kernels": "numpy", "slot_memory_mb": 4, "mtu": 9000},
        "multicast": {"enabled": False},
        "jobs": {"liveness_timeout_s": LIVENESS_S, "deadline_s": 2 * LIVENESS_S},
        "api": {"listen": f"127.0.0.1:{api_port}"},
    }


def test_workers_of_an_appliance_killed_under_them_are_told_it_ended_at_once() -> None:
    """Two ranks reduce in a loop; the daemon is killed with its cores. Each rank's call in
    flight fails with ApplianceEnded (its liveness timeout is a minute: only the refused API
    says so sooner); so does every later call, even once a new daemon runs (the job went with
    the old one), and closing the client (its leave finds no job) neither hangs nor raises."""
    cfg = _config()
    calls = [0, 0]
    failures: list[ReductionError | None] = [None, None]
    with local_daemon(cfg) as first:
        info = register(first.api, "killed", world_size=2, secret="secret-of-the-test")
        clients = [ApplianceClient([info], rank, local_address="127.0.0.1") for rank in (0, 1)]

        def reduce_until_it_fails(rank: int) -> None:
            try:
                while True:
                    x = np.full(20000, rank + 1.0, np.float32)
                    clients[rank].allreduce(x)
                    assert np.array_equal(x, np.full(20000, 3.0, np.float32))
                    calls[rank] += 1
            except ReductionError as exc:
                failures[rank] = exc

        threads = [threading.Thread(target=reduce_until_it_fails, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        wait_until(lambda: min(calls) >= 3, 30, what="three exact calls on each rank")
        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait()
        for t in threads:
            t.join(LIVENESS_S / 2)
    try:
        assert not any(t.is_alive() for t in threads), failures
        for rank, failure in enumerate(failures):
            assert type(failure) is ApplianceEnded, failure
            assert str(failure).startswith(f"appliance {info.appliance} has sent nothing for "), \
                failure
            assert f"while a round of rank {rank} waited on it" in str(failure), failure
            assert f"job {info.job_id} ('killed') went with it" in str(failure), failure
        with local_daemon(cfg):
            for client in clients:
                with pytest.raises(ApplianceEnded, match="no reductiond runs there"):  # for good
                    client.allreduce(np.ones(8, np.float32))
    finally:
        for client in clients:
            client.close()


def test_workers_of_a_job_lost_in_an_appliance_restart_are_told_at_their_next_call() -> None:
    """Two ranks reduce, then idle while the daemon is killed with its cores and started
    again. Each rank's next call fails with JobAborted naming the restart (the restarted
    cores answer its heartbeats that they have no such job, and the API lists none); so does
    every later call, and closing the client neither hangs nor raises."""
    cfg = _config()
    with local_daemon(cfg) as first:
        info = register(first.api, "restarted", world_size=2, secret="secret-of-the-test")
        clients = [ApplianceClient([info], rank, local_address="127.0.0.1") for rank in (0, 1)]
        allreduce_once_on_every_rank(clients, 20000, LIVENESS_S / 2)
        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait()
    try:
        with local_daemon(cfg):
            for rank, client in enumerate(clients):
                with pytest.raises(JobAborted) as failure:
                    client.allreduce(np.ones(8, np.float32))
                said = str(failure.value)
                assert said.startswith(f"the appliance at {info.appliance} restarted "), said
                assert f"after rank {rank} joined, and lost job {info.job_id} ('restarted')" \
                    in said
                with pytest.raises(JobAborted, match="restarted"):  # for good
                    client.allreduce(np.ones(8, np.float32))
    finally:
        for client in clients:
            client.close()
