"""An appliance stopped (SIGTERM) under a busy job on a rack that loses 5% of datagrams each
way: every rank finishes the same calls, and fails the next before any of its results reached
its tensor. Before the drain fenced the rounds, every rank's failed call left its tensor
partly summed (1 to 3 of 118 segments not), and at 20% loss one rank could fail a call its
peers had finished (docs/benchmarks-journal.md, "An appliance stopped under a busy job")."""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reduction_appliance.deploy.testnet.harness import LabNetwork, start_appliance

pytestmark = pytest.mark.slow

WORLD = 3
HERE = Path(__file__).parent


def test_a_stopped_appliance_under_loss_lets_every_rank_finish_the_same_calls() -> None:
    with LabNetwork.rack(WORLD, loss_pct=5.0) as net, start_appliance(net) as appliance:
        secret = secrets.token_urlsafe(12)
        procs = [net.popen_worker(rank, [
            sys.executable, str(HERE / "drain_worker.py"), appliance.api, "stopped", str(WORLD),
            str(rank), net.worker_address(rank), secret, str(1 << 18)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(WORLD)]
        try:
            for proc in procs:  # each has made three exact calls (a line, or its end)
                assert proc.stdout is not None
                assert proc.stdout.readline() == "READY\n", proc.communicate()[1][-2000:]
            appliance.process.send_signal(signal.SIGTERM)
            assert appliance.process.wait(timeout=60) == 0
            rows = []
            for proc in procs:
                out, err = proc.communicate(timeout=60)
                assert proc.returncode == 0, err[-2000:]
                rows.append(json.loads(out))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    calls = {row["calls"] for row in rows}
    assert len(calls) == 1, rows  # the same calls finished on every rank
    (done,) = calls
    for row in rows:
        assert row["error"] == "JobAborted", row
        assert re.search(rf"\(the appliance is shutting down: it let every round up to {done} "
                         rf"finish, and no later one begin\) during allreduce round {done + 1} ",
                         row["message"]), row
        assert row["intact"], row
