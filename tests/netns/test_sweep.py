"""`reductionctl bench` end to end on a small rack (not timed): both systems, both fan-out modes,
every result exact, and the three output files well-formed."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each


_ROOT = Path(__file__).resolve().parents[2]
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_tiny_sweep_through_reductionctl(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the Gloo pass needs torch.distributed")
    pytest.importorskip("matplotlib", reason="algbw.png needs the plot extra")
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_appliance.control.cli", "bench", "--network", "rack",
         "--workers", "2",
         "--rate", "200mbit", "--sizes", "4KiB,64KiB", "--dtypes", "fp32", "--iters", "1",
         "--modes", "multicast,unicast", "--out", str(out)],
        cwd=_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the honest figure" in proc.stdout  # the busbw note
    assert "6/6 cases" in proc.stderr  # the progress bar reached the end

    results = json.loads((out / "results.json").read_text())
    assert {"kernel", "cpu_count", "date"} <= set(results["environment"])
    assert results["plan"]["workers"] == [2] and results["plan"]["rate"] == "200mbit"
    rows = results["rows"]
    kinds = {(r["system"], r["mode"]) for r in rows}
    assert kinds == {("appliance", "multicast"), ("appliance", "unicast"), ("gloo", "ring")}
    assert len(rows) == 3 * 2
    for row in rows:
        assert row["ok"] and row["checked"] and not row.get("error"), row
        assert row["time_s"] > 0 and row["algbw_gbps"] > 0
        assert row["link_rx_util"] > 0 and row["link_tx_util"] > 0
        if row["system"] == "appliance":
            assert row["speedup"] > 0 and row["busbw_gbps"] is None
            assert row["appliance_cpu_cores"] >= 0
        else:
            assert row["busbw_gbps"] > 0 and row["speedup"] is None
    # One multicast copy per result, against one unicast copy per worker.
    by_mode = {r["mode"]: r for r in rows if r["size"] == 64 << 10 and r["system"] == "appliance"}
    assert by_mode["multicast"]["appliance_out_per_byte"] < 1.5
    assert by_mode["unicast"]["appliance_out_per_byte"] > 1.5

    with (out / "results.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert table and {"system", "mode", "workers", "size", "algbw_gbps", "link_rx_util",
                      "link_tx_util", "appliance_cpu_cores", "speedup", "ok"} <= set(table[0])
    assert all(r["ok"] == "true" for r in table)
    assert {r["system"] for r in table} == {"appliance", "gloo"}
    assert all(float(r["speedup"]) > 0 for r in table if r["system"] == "appliance")

    assert (out / "algbw.png").read_bytes()[:8] == _PNG_MAGIC
