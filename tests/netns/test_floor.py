"""bench.floor end to end (not timed): Gloo, the appliance and the floor on one loopback
namespace, each exact;
and a floor peer that hears nothing stops with the reason instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reduction_appliance.bench import floor_peer
from reduction_appliance.deploy.testnet.harness import LoopbackNetwork

pytestmark = pytest.mark.slow  # real worker processes: seconds each

_ROOT = Path(__file__).resolve().parents[2]


def _root_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the loopback network is a private namespace with multicast")


def test_floor_bench_runs_gloo_the_appliance_and_the_floor_exactly(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="bench.gloo_worker needs torch (torch.distributed gloo)")
    _root_or_skip()
    out = tmp_path / "floor.json"
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_appliance.bench.floor", "--network", "loopback",
         "--workers", "2", "--size", "1MiB", "--iters", "2", "--json", str(out)],
        cwd=_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads(out.read_text())
    (run,) = written["runs"]
    for system in ("gloo", "appliance"):
        assert run[system]["ok"] and run[system]["checked"], run[system]
    assert run["appliance_ratio"] == pytest.approx(run["gloo"]["time_s"]
                                                   / run["appliance"]["time_s"])
    result = run["floor"]
    assert result["ok"], result  # every element of every worker's result is the sum, 2
    # 1 MiB in loopback's 65408-byte segments: 16 whole ones, each timed iteration.
    assert result["segments"] == 16 and result["payload"] == 65408
    assert len(result["times"]) == 2 and all(t > 0 for t in result["times"])
    assert result["worker_receives"] >= 1 and result["worker_sends"] >= 1
    assert result["worker_cpu_s"] > 0 and run["floor_worker_cpu_s_per_gb"] > 0
    assert 0 <= result["worker_kernel_cpu_s"] <= result["worker_cpu_s"]
    ours = run["appliance"]
    assert 0 <= ours["worker_kernel_cpu_s_per_gb"] <= ours["worker_cpu_s_per_gb"], ours
    assert run["floor_ratio"] == pytest.approx(run["gloo"]["time_s"] / run["floor_time_s"])
    assert run["floor_kernel_s"] >= 0 and run["kernel_bound_s"] >= 0
    assert "run 1: gloo ring" in proc.stdout and "gloo/floor" in proc.stdout, proc.stdout
    assert "of the floor's speed" in proc.stdout, proc.stdout
    (before, after) = written["gauge_ms"]
    assert f"{before:.1f} ms before the run, {after:.1f} ms after" in proc.stdout


def test_a_floor_worker_that_hears_no_results_stops_with_the_reason() -> None:
    _root_or_skip()
    with LoopbackNetwork.create() as net:  # no appliance: its contributions go nowhere
        proc = net.popen_worker(0, [
            sys.executable, "-m", "reduction_appliance.bench.floor_peer", "worker",
            "--bind", "127.0.0.1", "--appliance", "127.0.0.1", "--workers", "2",
            "--segments", "4", "--payload", "8896", "--iters", "1", "--warmup", "0",
            "--silence-s", "0.5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        out, err = proc.communicate("go\ngo\n", timeout=60)  # the start, then the timed part
    assert [json.loads(line) for line in out.splitlines()] == [{"ready": True}, {"warm": True}]
    assert proc.returncode == floor_peer.LOST_EXIT  # (bench.floor runs it again)
    assert "4 results never came (lost: the floor has no recovery)" in err, err
    assert time.monotonic() - started < 30  # the silence bound, not the test's timeout
