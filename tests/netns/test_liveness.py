"""Fail fast, never hang: on the emulated rack, a killed rank is named to the others as ended
(its host says its port is closed), a slow rank is never declared dead, a dead appliance is
named to the workers, a stalled data-plane core is restarted while the daemon lives on, and a
job outlives a network outage shorter than the timeout and loses one round, saying why, to a
longer one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from reduction_appliance.deploy.testnet.harness import (
    LabNetwork,
    start_appliance,
)
from tests.waiting import wait_until

from .steered import Job, all_exact, start_a_long_run

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each

LIVENESS_S = 3.0
MIB = 1 << 20


def assert_named_within_the_bound(reports: list[dict[str, Any]], error: str, names: str,
                                  since: float, capsys: pytest.CaptureFixture[str],
                                  event: str) -> None:
    """Each report's first failure is `error` naming `names`, within the liveness bound."""
    for report in reports:
        first = report["failures"][0]
        assert first.startswith(error) and names in first, first
        assert report["first_failure"] - since <= LIVENESS_S + 1.0, report
        with capsys.disabled():
            print(f"\n{event}: {error} after {report['first_failure'] - since:.2f} s "
                  f"(liveness {LIVENESS_S:g} s)")


def test_a_killed_worker_is_named_ended_to_the_others_from_its_closed_port(
        capsys: pytest.CaptureFixture[str]) -> None:
    """RankEnded, which only the appliance's REACH and the worker host's ICMP port unreachable
    give (dataplane.reach): not RankSilent after the liveness timeout."""
    with LabNetwork.rack(3) as net, start_appliance(net, liveness_s=LIVENESS_S) as appliance:
        job = Job(net, appliance, "mortal", 3)
        try:
            assert all_exact(job.run(2, MIB))
            start_a_long_run(job, appliance)
            killed_at = time.monotonic()
            job.ranks[2].kill()
            reports = [survivor.next(timeout=60) for survivor in job.ranks[:2]]
            assert all(report["errors"] > 0 for report in reports), reports
            assert_named_within_the_bound(reports, "RankEnded", "rank 2 (198.18.0.103:",
                                          killed_at, capsys, "rank 2 killed, a survivor")
            assert appliance.counters()["ranks_ended"] >= 1
        finally:
            job.ranks = job.ranks[:2]
            job.close()


def test_a_slow_rank_is_never_declared_dead() -> None:
    with LabNetwork.rack(3) as net, start_appliance(net, liveness_s=LIVENESS_S) as appliance:
        job = Job(net, appliance, "patient", 3)
        try:
            assert all_exact(job.run(2, MIB))
            job.ranks[1].send(f"compute {3 * LIVENESS_S}")  # a long forward pass on rank 1
            for rank in (0, 2):
                job.ranks[rank].send(f"run 1 {MIB}")  # and the others wait for it meanwhile
            assert job.ranks[1].next(timeout=60)["computed"] == 3 * LIVENESS_S
            assert not any(j.get("silent") for j in appliance.status()["jobs"])
            job.ranks[1].send(f"run 1 {MIB}")
            assert all_exact([job.ranks[r].next(timeout=60) for r in range(3)])
            assert all_exact(job.run(3, MIB))
        finally:
            job.close()


def test_a_killed_appliance_is_named_ended_to_the_workers_from_its_refusing_api(
        capsys: pytest.CaptureFixture[str]) -> None:
    """ApplianceEnded, which only an overdue appliance whose API refuses a connection gives
    (plugin.silence): not ApplianceSilent after the liveness timeout. Every later call fails
    the same way: the job went with the daemon."""
    with LabNetwork.rack(2) as net, start_appliance(net, liveness_s=LIVENESS_S) as appliance:
        job = Job(net, appliance, "orphans", 2)
        try:
            assert all_exact(job.run(2, MIB))
            start_a_long_run(job, appliance)
            killed_at = time.monotonic()
            os.killpg(appliance.process.pid, signal.SIGKILL)  # reductiond and its cores
            reports = [rank.next(timeout=60) for rank in job.ranks]
            assert_named_within_the_bound(
                reports, "ApplianceEnded", "its host refuses a connection to its API: no "
                "reductiond runs there", killed_at, capsys, "reductiond killed, a worker")
            assert all(r["failures"][0].startswith(
                "ApplianceEnded: appliance 198.18.0.1:7070 has sent nothing for") for r in reports)
            for rank in job.ranks:
                rank.send(f"run 1 {MIB}")
            assert all(r["failures"][0].startswith("ApplianceEnded: ")
                       for r in (rank.next(timeout=60) for rank in job.ranks))
        finally:
            job.close()


@pytest.mark.parametrize("outage_s", [LIVENESS_S - 1, LIVENESS_S + 2])
def test_a_job_outlives_a_short_outage_and_a_long_one_costs_one_round_said_so(
        outage_s: float, capsys: pytest.CaptureFixture[str]) -> None:
    """The appliance's switch port goes down (a link flap, a switch rebooting) just as every
    rank starts a round, and comes back. Shorter than the liveness timeout: the round is exact,
    only late. Longer: it fails on every rank with ApplianceSilent, saying the network was out
    and is back, and that every rank must resync (the datagrams the outage took from every rank
    leave slot uses the appliance never saw); after that the rounds are exact. Such an outage
    once read as a firewall on the worker, and got every rank named silent to the others as it
    ended (their heartbeats still on their way)."""
    with LabNetwork.rack(3) as net, start_appliance(net, liveness_s=LIVENESS_S) as appliance:
        topology = net.lab.topology
        port = ["ip", "-n", topology.switch_netns, "link", "set", topology.port_ifname("a0")]
        job = Job(net, appliance, "flapped", 3)
        try:
            assert all_exact(job.run(2, MIB))
            subprocess.run([*port, "down"], check=True)
            for rank in job.ranks:
                rank.send(f"run 1 {64 * 1024}")  # its datagrams all lost
            time.sleep(outage_s)  # the outage itself: the port stays down this long
            subprocess.run([*port, "up"], check=True)
            reports = [rank.next(timeout=120) for rank in job.ranks]
            if outage_s > LIVENESS_S:  # as the error says
                for rank in job.ranks:
                    rank.send("resync")
                assert [rank.next()["resynced"] for rank in job.ranks] == [2, 2, 2]
            after = job.run(3, MIB)
        finally:
            job.close()
        assert all_exact(after), after
        assert appliance.counters()["job_outages"] >= 1
    for report in reports:
        if outage_s < LIVENESS_S:
            assert report["errors"] == 0 and report["exact"] == 1, report
            continue
        assert report["errors"] == 1, report
        (said,) = report["failures"]
        assert said.startswith("ApplianceSilent: appliance 198.18.0.1:7070 has sent nothing "
                               f"for {LIVENESS_S:.1f} s"), said
        assert "answered only after" in said and "and is back (a link flap" in said, said
        assert "call resync() on every rank" in said, said
    with capsys.disabled():
        slowest = max(max(report["times"] + [0.0]) for report in reports)
        failed = sum(r["errors"] for r in reports)
        print(f"\nthe appliance's port down {outage_s:g} s: {failed} rounds failed, the "
              f"slowest took {slowest:.2f} s; the next were exact")


def test_a_stalled_core_is_restarted_and_the_daemon_lives_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    with LabNetwork.rack(2) as net, start_appliance(net) as appliance:
        stalled = appliance.status()["cores"][0]["pid"]
        os.kill(stalled, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            core = wait_until(lambda: next(
                (c for c in appliance.status()["cores"]
                 if c["index"] == 0 and c["restarts"] == 1 and c["state"] == "running"), None),
                60, what="core 0 restarted after its stall")
            assert core["pid"] != stalled and "stalled" in core["last_exit"], core
            with capsys.disabled():
                print(f"\ncore 0 stopped: restarted and running after "
                      f"{time.monotonic() - stopped_at:.1f} s ({core['last_exit']})")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stalled, signal.SIGCONT)  # gone already: it was killed as stalled
        assert appliance.process.poll() is None  # the daemon lives
        job = Job(net, appliance, "after-stall", 2)
        try:
            assert all_exact(job.run(5, MIB))
        finally:
            job.close()
