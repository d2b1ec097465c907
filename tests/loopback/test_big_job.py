"""A job of 300 ranks on a real reductiond, 298 of them joined and then silent (their hosts lost
power, as far as the appliance can tell: their sockets stay open and say nothing): the two
ranks still there fail with an error that names eight of them and counts the rest, from a
LIVENESS that names the most telling hundred, and `reductionctl status` says it in a line,
not 298 (tests/unit/test_big_jobs.py has the parts; benchmarks-journal.md, "A job of a
thousand ranks", the measurements)."""

from __future__ import annotations

import contextlib
import re
import socket
import threading

import numpy as np
import pytest

from reduction_appliance.bench import heartbeats, joins
from reduction_appliance.client import ApplianceClient, register
from reduction_appliance.control.apiclient import UnixApi
from reduction_appliance.control.ctl import render_status
from reduction_appliance.dataplane.errors import RankSilent
from reduction_appliance.deploy.testnet.harness import local_daemon
from reduction_appliance.plugin.rendezvous import join
from tests.waiting import wait_until

from .test_eviction import _free_udp_ports
from .test_prometheus import _free_tcp_port

pytestmark = pytest.mark.slow  # a daemon and 298 joins: seconds

WORLD = 300


def test_a_job_that_lost_most_of_its_ranks_reads_in_a_few_lines() -> None:
    cfg = {
        "dataplane": {"address": "127.0.0.1", "base_port": _free_udp_ports(2), "cores": 2,
                      "cpus": [], "kernels": "numpy", "slot_memory_mb": 4, "mtu": 9000},
        "multicast": {"enabled": False},
        "jobs": {"liveness_timeout_s": 1.0},
        "api": {"listen": f"127.0.0.1:{_free_tcp_port()}"},
    }
    with local_daemon(cfg) as daemon, contextlib.ExitStack() as stack:
        info = register(daemon.api, "big", world_size=WORLD, secret="s")
        for rank in range(2, WORLD):
            quiet = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            quiet.bind(("127.0.0.1", 0))
            join(info, rank, quiet.getsockname())
        api = UnixApi(daemon.unix_socket)
        wait_until(lambda: len(api.request("GET", "/v1/status")["jobs"][0]["silent"]) == 298,
                   30, what="the 298 quiet ranks to pass the liveness timeout")
        clients = [stack.enter_context(ApplianceClient([info], rank, local_address="127.0.0.1"))
                   for rank in (0, 1)]
        failures: dict[int, BaseException] = {}

        def reduce(rank: int) -> None:
            try:
                clients[rank].allreduce(np.ones(1000, np.float32))
            except BaseException as exc:  # (what the test looks at)
                failures[rank] = exc
        threads = [threading.Thread(target=reduce, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(failures) == [0, 1], failures
        for exc in failures.values():
            text = str(exc)
            assert type(exc) is RankSilent, text
            assert len(text) < 700, text
            assert re.match(r"rank 2 \(127\.0\.0\.1:\d+\); rank 3 \(127\.0\.0\.1:\d+\); ", text)
            # 100 named (wire.SILENT_RECORDS), 8 of them with their endpoints, 298 in all
            assert "; and 290 more (10-101, ...) silent for " in text, text
        lines = render_status(api.request("GET", "/v1/status"))
        silent = [line for line in lines.splitlines() if "silent" in line]
        assert len(silent) == 1 and re.fullmatch(
            r" +! 298 ranks silent for [\d.-]+ s: ranks 2-299", silent[0]), lines
        assert len(lines.splitlines()) < 30, lines


def test_the_heartbeat_bench_measures_a_core(capsys: pytest.CaptureFixture[str]) -> None:
    """bench.heartbeats: a row per job size, with the core's CPU per heartbeat; bad sizes are
    refused before anything starts."""
    assert heartbeats.main(["--ranks", "8", "--rate", "400", "--seconds", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["ranks", "heartbeats/s", "us", "each", "core", "busy", "at",
                              "the", "ranks", "own", "rate"]
    rows = [line.split() for line in out[2:]]
    assert [row[0] for row in rows] == ["8"]
    assert all(150 < float(row[1]) <= 420 and float(row[2]) > 0 for row in rows), out
    for bad in (["--ranks", "0"], ["--ranks", "5000"], ["--ranks", "a,b"], ["--rate", "0"]):
        with pytest.raises(SystemExit) as stopped:
            heartbeats.main(bad)
        assert stopped.value.code == 2


def test_the_join_bench_joins_and_leaves_every_rank_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    """bench.joins: ranks of two client processes join a real reductiond at the same moment,
    then leave at the same moment; each is answered, listed as joined, and the last leave
    ends the job (else it fails, saying which)."""
    assert joins.main(["--ranks", "96", "--clients", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:4] == ["ranks", "all", "done", "in"]
    rows = [line.split() for line in out[2:4]]
    assert [row[:2] for row in rows] == [["96", "join"], ["96", "leave"]], out
    # (columns: ..., clients' CPU per call, "ms", calls failed, attempts given up)
    assert all(float(row[2]) > 0 and float(row[-4]) > 0 and row[-2] == "0" and row[-1].isdigit()
               for row in rows), out
    for bad in (["--ranks", "0"], ["--ranks", "5000"], ["--ranks", "x"], ["--clients", "0"]):
        with pytest.raises(SystemExit) as stopped:
            joins.main(bad)
        assert stopped.value.code == 2
