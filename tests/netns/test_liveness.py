"""Fail fast, never hang: on the emulated rack, a dead rank is named to the others within the
liveness timeout, a slow rank is never declared dead, a dead appliance is named to the workers,
and a stalled data-plane core is restarted while the daemon lives on."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from reduction_appliance.deploy.testnet.harness import LabNetwork, start_appliance
from tests.waiting import wait_until

from .steered import Job, all_exact

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each

LIVENESS_S = 3.0
MIB = 1 << 20


def test_a_killed_worker_is_named_to_the_others_within_the_liveness_timeout(
        capsys: pytest.CaptureFixture[str]) -> None:
    with LabNetwork.rack(3) as net, start_appliance(net, liveness_s=LIVENESS_S) as appliance:
        job = Job(net, appliance, "mortal", 3)
        try:
            assert all_exact(job.run(2, MIB))
            for rank in job.ranks:
                rank.send(f"run 1000 {MIB}")  # long enough to be killed in the middle
            reduced = appliance.counters()["segments_reduced"]
            wait_until(lambda: appliance.counters()["segments_reduced"] > reduced + 100, 30,
                       what="the long run under way")
            killed_at = time.monotonic()
            job.ranks[2].kill()
            for survivor in job.ranks[:2]:
                report = survivor.next(timeout=60)
                assert report["errors"] > 0, report
                first = report["failures"][0]
                assert first.startswith("RankSilent") and "rank 2 (198.18.0.103:" in first, first
                assert report["first_failure"] - killed_at <= LIVENESS_S + 1.0, report
                with capsys.disabled():
                    print(f"\nrank 2 killed: a survivor raised RankSilent after "
                          f"{report['first_failure'] - killed_at:.2f} s "
                          f"(liveness {LIVENESS_S:g} s)")
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


def test_a_killed_appliance_is_named_to_the_workers_within_the_bound(
        capsys: pytest.CaptureFixture[str]) -> None:
    with LabNetwork.rack(2) as net, start_appliance(net, liveness_s=LIVENESS_S) as appliance:
        job = Job(net, appliance, "orphans", 2)
        try:
            assert all_exact(job.run(2, MIB))
            for rank in job.ranks:
                rank.send(f"run 1000 {MIB}")
            reduced = appliance.counters()["segments_reduced"]
            wait_until(lambda: appliance.counters()["segments_reduced"] > reduced + 100, 30,
                       what="the long run under way")
            killed_at = time.monotonic()
            os.killpg(appliance.process.pid, signal.SIGKILL)  # reductiond and its cores
            for rank in job.ranks:
                report = rank.next(timeout=60)
                first = report["failures"][0]
                assert first.startswith("ApplianceSilent") and "core 0" in first, first
                assert report["first_failure"] - killed_at <= LIVENESS_S + 1.0, report
                with capsys.disabled():
                    print(f"\nreductiond killed: a worker raised ApplianceSilent after "
                          f"{report['first_failure'] - killed_at:.2f} s "
                          f"(liveness {LIVENESS_S:g} s)")
        finally:
            job.close()


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
