"""The README's main command, `bash scripts/main`, as a user runs it: it must find its module
and reduce real tensors exactly (it once named a module that had moved, and nothing noticed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # an emulated rack, a daemon and worker processes


def test_scripts_main_reduces_real_tensors_exactly() -> None:
    # The project venv exists wherever the suite runs through scripts/test (it makes it
    # first); elsewhere the script makes it, as on a fresh clone.
    run = subprocess.run(
        ["bash", "scripts/main", "--workers", "2", "--sizes", "1KiB,64KiB",
         "--dtypes", "fp32,bf16", "--iters", "1"],
        cwd=_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "all 4 cases exact against the numpy reference" in run.stdout, run.stdout[-2000:]
    # each case's row: its retransmissions and their share of the segments sent
    rows = re.findall(r"GB/s +\d+ \( *\d+\.\d%\)  exact$", run.stdout, re.MULTILINE)
    assert len(rows) == 4, run.stdout[-2000:]
