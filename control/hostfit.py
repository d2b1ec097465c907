"""Whether the data-plane cores fit this host (its memory, its CPUs), said before they start.

Each core maps one arena (`dataplane.slots.SlotArena`: `dataplane.slot_memory_mb` of slot
pairs plus its receive buffers) lazily: pages are touched as jobs fill their slots. An arena
larger than the host's memory fails at the core's start with a bare `ENOMEM`; cores whose
arenas together come near it start, and once jobs fill them the kernel's OOM killer ends a
core in the middle of training. The operator hears it in their own terms instead: the
daemon and `reductionctl check-config` refuse the first and warn about the second.

Each core pins itself to its `dataplane.cpus` entry at its start: a CPU this host lacks (or
its cpuset withholds) killed the core there with a traceback ending in `sched_setaffinity`'s
bare EINVAL. The CPUs are tried here instead, by pinning the calling thread to each in turn
and back: the daemon's own affinity does not say (a tuned host keeps it off the cores'
isolated CPUs, which pinning may still use). More unpinned cores than the daemon's CPUs are
warned about: they take turns on them.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from reduction_appliance.dataplane.errors import ConfigError
from reduction_appliance.dataplane.slots import arena_bytes

from .config import ApplianceConfig

__all__ = ["MEMINFO", "cpu_verdict", "host_memory_bytes", "host_verdicts", "slot_memory_verdict",
           "unpinnable_cpus"]

MEMINFO = Path("/proc/meminfo")
# Above this share of the host's memory the cores' arenas leave too little to the daemon, the
# kernel's socket buffers and page cache, and whatever else runs there.
_MOST_SHARE = 0.8


def host_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemTotal, or None where the file does not say (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def slot_memory_verdict(cfg: ApplianceConfig, host_bytes: int | None) -> str | None:
    """A warning where the cores' arenas come near `host_bytes` (None where they fit well, or
    the host's memory is unknown); raises `ConfigError` where they exceed it."""
    if host_bytes is None:
        return None
    dp = cfg.dataplane
    each = arena_bytes(cfg.slot_capacity, cfg.arena_payload, dp.rx_buffers)
    total = each * dp.cores
    what = (f"dataplane.slot_memory_mb = {dp.slot_memory_mb} maps {_gib(each)} per core "
            f"(slots and receive buffers), {_gib(total)} for the {dp.cores} cores")
    if total > host_bytes:
        raise ConfigError(f"{cfg.source}: {what}: more than this host's {_gib(host_bytes)} of "
                          "memory; lower dataplane.slot_memory_mb (or dataplane.cores)")
    if total > _MOST_SHARE * host_bytes:
        return (f"{what}: {total / host_bytes:.0%} of this host's {_gib(host_bytes)} of memory; "
                "once jobs fill their slots the kernel may kill a core (out of memory). Lower "
                "dataplane.slot_memory_mb unless this host does nothing else")
    return None


def unpinnable_cpus(cpus: Iterable[int]) -> dict[int, str]:
    """Each of `cpus` that a thread of this host cannot be pinned to, with the reason; the
    calling thread's affinity is as before afterwards."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    before = os.sched_getaffinity(0)
    refused: dict[int, str] = {}
    try:
        for cpu in cpus:
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError as exc:  # EINVAL: the kernel's word for both of these
                refused[cpu] = ("not on this host, or outside its cpuset"
                                if exc.errno == errno.EINVAL else exc.strerror or str(exc))
    finally:
        os.sched_setaffinity(0, before)
    return refused


def cpu_verdict(cfg: ApplianceConfig, daemon_cpus: int | None,
                refused: Callable[[Iterable[int]], dict[int, str]] = unpinnable_cpus
                ) -> str | None:
    """A warning where unpinned cores outnumber the `daemon_cpus` they run on (None where they
    do not, or that is unknown); raises `ConfigError` where `dataplane.cpus` names a CPU that
    `refused` says no thread can be pinned to."""
    dp = cfg.dataplane
    bad = refused(dp.cpus)
    if bad:
        which = ", ".join(f"{cpu} ({why})" for cpu, why in sorted(bad.items()))
        raise ConfigError(f"{cfg.source}: dataplane.cpus: no core can be pinned to CPU {which}"
                          f"; this host has {os.cpu_count()} CPU(s): list CPUs it has (and "
                          "its cpuset allows), or leave dataplane.cpus empty")
    if dp.cpus or daemon_cpus is None or dp.cores <= daemon_cpus:
        return None
    return (f"dataplane.cores = {dp.cores}, unpinned, on the {daemon_cpus} CPU(s) reductiond "
            "may use: the cores take turns on them"
            + (" (and busy-polling ones never yield theirs)" if dp.poll == "busy" else "")
            + "; lower dataplane.cores, or pin them with dataplane.cpus")


def host_verdicts(cfg: ApplianceConfig) -> list[str]:
    """What the cores' memory and CPUs make of this host: warnings to log; raises
    `ConfigError` where the cores cannot start here."""
    said = [slot_memory_verdict(cfg, host_memory_bytes()),
            cpu_verdict(cfg, len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else None)]
    return [warning for warning in said if warning]
