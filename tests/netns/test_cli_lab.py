"""`reductionctl lab`: a rack that outlives the command, listed, reachable, and fully removed."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reduction_appliance.deploy.testnet import LabError, clean, leftovers, unique_prefix
from reduction_appliance.deploy.testnet.standing import down

_ROOT = Path(__file__).resolve().parents[2]


def ctl(state: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reduction_appliance.control.cli", "lab", "--state-dir",
         str(state), *argv],
        cwd=_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )


def test_lab_up_list_ping_down(tmp_path: Path) -> None:
    name = unique_prefix("rctl")
    try:
        up = ctl(tmp_path, "up", "--workers", "2", "--rate", "200mbit", "--name", name, "--json")
        assert up.returncode == 0, up.stderr
        lab = json.loads(up.stdout)
        assert (tmp_path / f"{name}.json").exists()
        hosts = {h["name"]: h for h in lab["hosts"]}
        assert set(hosts) == {"a0", "w0", "w1"} and lab["state"] == "up"

        # The rack outlived `lab up`: list shows it, and its hosts reach each other.
        listed = ctl(tmp_path, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [(x["name"], x["state"]) for x in json.loads(listed.stdout)] == [(name, "up")]
        assert name in ctl(tmp_path, "list").stdout
        ping = subprocess.run(
            ["ip", "netns", "exec", hosts["w0"]["netns"], "ping", "-c", "1", "-W", "5",
             hosts["w1"]["address"]], capture_output=True, text=True, timeout=30, check=False)
        assert ping.returncode == 0, ping.stdout + ping.stderr

        again = ctl(tmp_path, "up", "--workers", "2", "--name", name)
        assert again.returncode == 1 and "exists" in again.stderr

        gone = ctl(tmp_path, "down", name)
        assert gone.returncode == 0, gone.stderr
        assert leftovers(name) == []
        assert not (tmp_path / f"{name}.json").exists()
        assert ctl(tmp_path, "list", "--json").stdout.strip() == "[]"
        assert ctl(tmp_path, "down", name).returncode == 1  # nothing left to take down
    finally:
        with contextlib.suppress(LabError):
            down(name, tmp_path)
    assert leftovers(name) == []


def test_lab_usage_errors_exit_2(tmp_path: Path) -> None:
    assert ctl(tmp_path, "up", "--workers", "2", "--name", "Bad-Name").returncode == 2
    assert ctl(tmp_path, "up", "--workers", "2", "--rate", "fast").returncode == 2
    assert ctl(tmp_path, "down").returncode == 2
    assert ctl(tmp_path, "frobnicate").returncode == 2


def test_lab_roce_runs_a_command_where_soft_roce_devices_are_active(tmp_path: Path) -> None:
    """`reductionctl lab roce` boots the project's guest (scripts/test set it up first)."""
    lab = os.environ.get("ROCE_LAB_UNAVAILABLE")
    if lab:
        pytest.skip(f"no soft-RoCE lab on this machine: {lab}")
    done = subprocess.run(
        [sys.executable, "-m", "reduction_appliance.control.cli", "lab", "roce", "--rxe", "2",
         "--timeout", "600", "--", "rdma", "link"],
        cwd=_ROOT, capture_output=True, text=True, timeout=700, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("state ACTIVE") == 2, done.stdout
    assert "rxe1/1" in done.stdout and "rxe2/1" in done.stdout
    assert ctl(tmp_path, "roce").returncode == 2  # no command: usage


KILLED_RUN = """
import signal
from reduction_appliance.deploy.testnet import Lab, Topology
with Lab(Topology.rack(workers=1)) as lab:
    print(lab.topology.name_prefix, flush=True)
    while True:
        signal.pause()  # until the test kills this process outright
"""


def test_a_rack_left_by_a_killed_run_is_listed_and_taken_down_by_name(tmp_path: Path) -> None:
    """A run killed outright (SIGKILL, the OOM killer) cannot tear its rack down: `lab list`
    said "no standing labs" over its namespaces, and `lab down` did not know the name."""
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN], stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    prefix = run.stdout.readline().strip()
    try:
        assert prefix and leftovers(prefix) != []
        listed = ctl(tmp_path, "list")
        assert f"left by a run that is gone: {prefix}" not in listed.stdout  # its maker runs
        run.kill()
        run.wait()
        listed = ctl(tmp_path, "list")
        assert listed.returncode == 0
        assert (f"left by a run that is gone: {prefix} (3 namespaces); `reductionctl lab down "
                f"{prefix}` removes it") in listed.stdout
        taken = ctl(tmp_path, "down", prefix)
        assert taken.returncode == 0, taken.stderr
        assert leftovers(prefix) == []
        assert prefix not in ctl(tmp_path, "list").stdout
    finally:
        run.kill()
        run.wait()
        with contextlib.suppress(LabError, ValueError):
            clean(prefix)
