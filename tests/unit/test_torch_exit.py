"""plugin.torch_exit: output written before it survives, finalization does not run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_PROGRAM = """
import atexit, sys
from reduction_appliance.plugin.torch_exit import exit_without_finalizing
atexit.register(print, "finalized")
sys.stdout.write("report")  # buffered: no newline, no flush
sys.stderr.write("note")
exit_without_finalizing(3)
"""


def test_flushes_then_leaves_with_the_status_and_no_finalization() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROGRAM], cwd=_ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 3
    assert proc.stdout == "report" and proc.stderr == "note"
