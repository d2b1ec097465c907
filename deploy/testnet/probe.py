"""What a worker samples around each timed allreduce: its link's byte counters, the
appliance's CPU time, and the whole machine's CPU time split into user space and the kernel,
with what was left idle and what the hypervisor took (steal).

The sampling lives in the worker, not the driver, so that numerator and denominator cover the
same interval: bytes and CPU seconds are summed over exactly the timed calls, divided by exactly
their durations. Sampled from the driver before and after a case they would also count process
start-up, registration, warmup iterations and the reference checks, and overstate utilisation.

The machine's split (/proc/stat: every process and interrupt, in 10 ms ticks) is what compares
systems on one emulated network: every host shares these cores, so the CPU a system spends per
allreduced byte, and how much of it the kernel's network path takes, decides its speed once
the links are fast. Idle and steal say which bound a figure met: a machine left almost no
idle time in the timed calls (busy, or stolen) was CPU-bound, whatever its links. The time a
virtual machine's hypervisor gave to other guests (steal) is CPU no system here had, the noise
every figure from a shared machine should be read with.

Link counters come from /sys/class/net inside the worker's own namespace (`ip netns exec`
mounts that namespace's sysfs). CPU time comes from /proc, whose pids are global here: the lab
has network namespaces only, not pid namespaces.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

__all__ = ["MachineTime", "Probe", "Sample", "cpu_seconds", "descendants", "link_bytes",
           "machine_cpu"]

_TICK_HZ = os.sysconf("SC_CLK_TCK")


def link_bytes(ifname: str) -> tuple[int, int]:
    """(rx, tx) bytes of an interface of this process's network namespace."""
    base = Path("/sys/class/net", ifname, "statistics")
    return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())


class MachineTime(NamedTuple):
    """Seconds every CPU of the machine has spent so far, by what it did."""

    user: float  # user + nice
    kernel: float  # system + irq + softirq: the network path of every namespace (sockets,
    # veths, the bridge, qdiscs)
    idle: float  # idle + iowait
    steal: float  # taken by the hypervisor for other guests (0 on bare metal)


_NO_TIME = MachineTime(0.0, 0.0, 0.0, 0.0)


def machine_cpu() -> MachineTime:
    """The machine's CPU time so far (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0  # (kernels before 2.6.11 had no steal)
    return MachineTime((user + nice) / _TICK_HZ, (system + irq + softirq) / _TICK_HZ,
                       (idle + iowait) / _TICK_HZ, steal / _TICK_HZ)


def _task_seconds(pid: int) -> float:
    """On-CPU seconds of every live thread of `pid`, in nanoseconds from schedstat: utime+stime
    tick at 10 ms, coarser than a small allreduce. Falls back to the ticks without schedstat."""
    total = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0  # exited
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except FileNotFoundError:
            return _stat_seconds(pid)
        except (OSError, ValueError, IndexError):
            continue  # the thread exited meanwhile
    return total


def _stat_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK_HZ


def cpu_seconds(pids: tuple[int, ...]) -> float:
    return sum(_task_seconds(pid) for pid in pids)


def descendants(pid: int) -> tuple[int, ...]:
    """`pid` and all its live descendants (reductiond runs each data-plane core in a child)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [pid], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found.extend(kids)
        frontier.extend(kids)
    return tuple(found)


@dataclass(frozen=True)
class Sample:
    rx: int
    tx: int
    cpu_s: float
    at: float  # monotonic midpoint of the reads: they take a while, and the counters move
    machine: MachineTime = _NO_TIME  # machine_cpu(), when probed


@dataclass
class Probe:
    """Sums link bytes and CPU seconds over the timed calls: `before()` right before a call,
    `after(seconds)` right after it with the call's own duration.

    Reading a dozen /proc and /sys files takes tens of microseconds, as long as a small
    allreduce: the counters are therefore divided by `probed_s`, the time between the
    midpoints of the reads, not by the call's own duration (`seconds`)."""

    ifname: str | None = None
    pids: tuple[int, ...] = ()
    seconds: float = 0.0
    probed_s: float = 0.0
    rx: int = 0
    tx: int = 0
    cpu_s: float = 0.0
    machine: bool = False  # also sum the machine's user, kernel, idle and steal seconds
    machine_user_s: float = 0.0
    machine_kernel_s: float = 0.0
    machine_idle_s: float = 0.0
    machine_steal_s: float = 0.0
    window: list[float] = field(default_factory=list)  # monotonic [first start, last end]
    _start: Sample | None = None

    def _sample(self) -> Sample:
        start = time.monotonic()
        rx, tx = link_bytes(self.ifname) if self.ifname else (0, 0)
        cpu = cpu_seconds(self.pids) if self.pids else 0.0
        machine = machine_cpu() if self.machine else _NO_TIME
        return Sample(rx, tx, cpu, (start + time.monotonic()) / 2, machine)

    def before(self) -> None:
        self._start = self._sample()
        if not self.window:
            self.window = [time.monotonic(), 0.0]

    def after(self, seconds: float) -> None:
        end = self._sample()
        self.window[1] = time.monotonic()
        assert self._start is not None, "Probe.after() without before()"
        self.seconds += seconds
        self.probed_s += end.at - self._start.at
        self.rx += end.rx - self._start.rx
        self.tx += end.tx - self._start.tx
        self.cpu_s += end.cpu_s - self._start.cpu_s
        self.machine_user_s += end.machine.user - self._start.machine.user
        self.machine_kernel_s += end.machine.kernel - self._start.machine.kernel
        self.machine_idle_s += end.machine.idle - self._start.machine.idle
        self.machine_steal_s += end.machine.steal - self._start.machine.steal

    def report(self) -> dict[str, object]:
        """What the worker prints: the window always, the sums only for what was probed."""
        out: dict[str, object] = {"window": self.window, "timed_s": self.seconds,
                                  "probed_s": self.probed_s}
        if self.ifname:
            out["link"] = {"ifname": self.ifname, "rx": self.rx, "tx": self.tx}
        if self.pids:
            out["appliance_cpu_s"] = self.cpu_s
        if self.machine:
            out["machine_cpu_s"] = {"user": self.machine_user_s, "kernel": self.machine_kernel_s,
                                    "idle": self.machine_idle_s, "steal": self.machine_steal_s}
        return out
