"""CPU time from /proc: of a process and all its descendants, and of the whole machine.

On the development rack every namespace shares the same few cores, so the appliance's own CPU
comes out of the workers' budget (on a real rack it has a server to itself). The benchmarks
report both figures so that a reader can tell a slow network from a starved CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuSample", "machine_busy_s", "tree_cpu_s"]

_PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name, or None if the process is gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name sits in parentheses and may itself hold spaces or parentheses.
    return raw.rsplit(")", 1)[1].split()


def _children(parents: set[int]) -> dict[int, list[str]]:
    """Every live process whose parent is in `parents`, with its stat fields."""
    found = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) in parents:
                found[int(entry.name)] = fields
    return found


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of `pid` and its live descendants (and of their reaped children).
    0.0 if `pid` is gone."""
    own = _stat_fields(pid)
    if own is None:
        return 0.0
    ticks = 0
    level = {pid: own}
    while level:
        # utime, stime, cutime, cstime: fields 14-17 of stat(5), 11-14 after the name.
        ticks += sum(sum(int(f) for f in fields[11:15]) for fields in level.values())
        level = _children(set(level))
    return ticks * _TICK_S


def machine_busy_s() -> float:
    """Seconds every CPU of the machine spent neither idle nor waiting on I/O, summed."""
    with (_PROC / "stat").open() as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle, iowait = values[3], values[4]
    # guest time is already counted in user time.
    return (sum(values[:8]) - idle - iowait) * _TICK_S


@dataclass(frozen=True)
class CpuSample:
    """A point in time to measure CPU use from: the machine's, and one process tree's."""

    machine_s: float
    tree_s: float

    @classmethod
    def take(cls, pid: int | None) -> CpuSample:
        return cls(machine_busy_s(), tree_cpu_s(pid) if pid is not None else 0.0)

    def since(self, earlier: CpuSample) -> CpuSample:
        return CpuSample(self.machine_s - earlier.machine_s, self.tree_s - earlier.tree_s)
