"""bench.ddp_steps end to end on a tiny configuration (not timed): the three runs happen, the
table and ddp_steps.json come out well-formed, and every run's ranks agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each


_ROOT = Path(__file__).resolve().parents[2]


def test_tiny_ddp_steps_bench(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the example trains with torch")
    steps, warmup = 12, 2
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_appliance.bench.ddp_steps", "--workers", "2",
         "--rate", "1gbit",
         "--steps", str(steps), "--warmup", str(warmup), "--hidden", "64", "--layers", "2",
         "--bucket-mb", "0.01", "--out", str(tmp_path)],
        cwd=_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3/3 cases" in proc.stderr  # the progress bar reached the end
    table = {line.split()[0]: line for line in proc.stdout.splitlines()
             if line.split()[:1] in (["gloo"], ["reduction"], ["hook"])}
    assert set(table) == {"gloo", "reduction", "hook"}, proc.stdout
    assert all(line.endswith("identical") for line in table.values()), proc.stdout

    results = json.loads((tmp_path / "ddp_steps.json").read_text())
    assert results["plan"]["workers"] == 2 and results["plan"]["rate"] == "1gbit"
    assert {"kernel", "cpu_count", "torch"} <= set(results["environment"])
    before, after = results["gauge_ms"]  # the machine's speed around the run (bench.gauge)
    assert f"{before:.1f} ms before the run, {after:.1f} ms after" in proc.stdout, proc.stdout
    rows = {row["comm"]: row for row in results["rows"]}
    assert list(rows) == ["gloo", "reduction", "hook"]
    for comm, row in rows.items():
        assert row["ranks_agree"], comm
        assert len(row["step_ms"]) == steps - warmup
        assert 0 < row["step_ms_median"] <= max(row["step_ms"])
        assert row["speedup"] > 0
        assert len(row["bucket_bytes"]) >= 2, row["bucket_bytes"]
        assert 0 < row["machine_busy"] <= 1.05, row["machine_busy"]  # tick granularity
    assert rows["gloo"]["speedup"] == 1.0 and rows["gloo"]["appliance_counters"] is None
    assert rows["gloo"]["appliance_cpu_ms_per_step"] is None  # no appliance ran
    for comm in ("reduction", "hook"):
        reduced = rows[comm]["appliance_counters"]["bytes_reduced"]
        assert reduced >= steps * rows[comm]["grad_bytes"], (comm, reduced)
        assert rows[comm]["appliance_cpu_ms_per_step"] > 0
