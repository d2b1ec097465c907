"""Whether the data-plane cores' memory fits this host, said before they start.

Each core maps one arena (`dataplane.slots.SlotArena`: `dataplane.slot_memory_mb` of slot
pairs plus its receive buffers) lazily: pages are touched as jobs fill their slots. An arena
larger than the host's memory fails at the core's start with a bare `ENOMEM`; cores whose
arenas together come near it start, and once jobs fill them the kernel's OOM killer ends a
core in the middle of training. The operator hears it in their own terms instead: the
daemon and `reductionctl check-config` refuse the first and warn about the second.
"""

from __future__ import annotations

from pathlib import Path

from reduction_appliance.dataplane.errors import ConfigError
from reduction_appliance.dataplane.slots import arena_bytes

from .config import ApplianceConfig

__all__ = ["MEMINFO", "host_memory_bytes", "slot_memory_verdict"]

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
