"""bench.cputime against processes that burn a known amount of CPU."""

from __future__ import annotations

import os
import subprocess
import sys

from reduction_appliance.bench.cputime import CpuSample, machine_busy_s, tree_cpu_s

# Burns `BURN_S` of its own CPU, then says so and waits for stdin to close.
_BURN = """
import sys, time
while time.process_time() < {burn}:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""
BURN_S = 0.3
# /proc counts CPU time in clock ticks, rounded down per process and per field: a couple of
# ticks short of what the process measured itself is the same time.
SLACK_S = 3 / os.sysconf("SC_CLK_TCK")


def _burner(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_a_live_grandchild_counts_towards_the_tree() -> None:
    # The child starts a burning grandchild and relays its "burnt"; both stay alive.
    relay = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', "
             f"{_BURN.format(burn=BURN_S)!r}], stdout=subprocess.PIPE, text=True)\n"
             "print(p.stdout.readline(), end='', flush=True)\nsys.stdin.read()\n"
             "p.kill()\np.wait()\n")
    with _burner(relay) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "burnt\n"
        before_exit = tree_cpu_s(child.pid)
        child.stdin.close()
    assert before_exit >= BURN_S - SLACK_S
    assert tree_cpu_s(child.pid) == 0.0  # gone


def test_reaped_children_count_towards_their_parent() -> None:
    before = CpuSample.take(os.getpid())
    with _burner(_BURN.format(burn=BURN_S)) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "burnt\n"
        child.stdin.close()
    spent = CpuSample.take(os.getpid()).since(before)
    assert spent.tree_s >= BURN_S - SLACK_S  # our cutime took the child's in when we reaped it
    assert spent.machine_s >= BURN_S - SLACK_S


def test_machine_busy_never_goes_back() -> None:
    first = machine_busy_s()
    assert first > 0 and machine_busy_s() >= first
