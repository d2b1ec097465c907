"""bench.allreduce end to end (not timed): both systems on one loopback namespace, both exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each


_ROOT = Path(__file__).resolve().parents[2]


def test_allreduce_bench_runs_both_systems_exactly(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="bench.gloo_worker needs torch (torch.distributed gloo)")
    if os.geteuid() != 0:
        pytest.skip("needs root: the loopback network is a private namespace with multicast")
    out = tmp_path / "allreduce.json"
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_appliance.bench.allreduce", "--network", "loopback",
         "--workers", "2",
         "--sizes", "64KiB", "--iters", "1", "--json", str(out)],
        cwd=_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert len(rows) == 1
    (before, after), = written["gauge_ms"]  # the machine's speed around the one run
    assert before > 0 and after > 0
    assert f"{before:.1f} ms before the run, {after:.1f} ms after" in proc.stdout, proc.stdout
    row = rows[0]
    assert (row["size"], row["dtype"], row["op"], row["workers"]) == (65536, "float32", "sum", 2)
    for system in ("appliance", "gloo"):
        result = row[system]
        assert not result.get("skipped"), result
        assert result["checked"] and result["ok"], result
        assert result["time_s"] > 0 and len(result["times"]) == 1
        # The machine's CPU over the timed call (10 ms ticks: a 64 KiB call may read 0).
        assert result["machine_cpu_s_per_gb"] >= 0
        assert result["machine_kernel_share"] is None or 0 <= result["machine_kernel_share"] <= 1
    assert row["speedup"] > 0
