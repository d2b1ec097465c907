"""The cores' memory and CPUs against the host's, said in the operator's terms before the cores
start (a core once died at its start with a bare ENOMEM, or later, killed mid-training; or
with sched_setaffinity's bare EINVAL)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.hostfit import (
    cpu_verdict,
    host_memory_bytes,
    slot_memory_verdict,
    unpinnable_cpus,
)
from reduction_appliance.dataplane.errors import ConfigError
from reduction_appliance.dataplane.slots import SlotArena, arena_bytes

GIB = 2**30


def config(slot_memory_mb: int, cores: int = 2):  # type: ignore[no-untyped-def]
    return parse({"dataplane": {"slot_memory_mb": slot_memory_mb, "cores": cores, "mtu": 9000}},
                  source="appliance.toml")


def test_the_arena_size_is_what_a_core_maps() -> None:
    cfg = config(8)
    with SlotArena(cfg.slot_capacity, cfg.arena_payload, cfg.dataplane.rx_buffers) as arena:
        assert arena.nbytes == arena_bytes(cfg.slot_capacity, cfg.arena_payload,
                                           cfg.dataplane.rx_buffers)


def test_cores_that_cannot_fit_are_refused_and_crowded_ones_warned_about() -> None:
    host = 24 * GIB
    assert slot_memory_verdict(config(4096), host) is None  # 2 x ~4 GiB: a third
    crowded = slot_memory_verdict(config(10240), host)  # 2 x ~10 GiB: 85%
    assert crowded is not None and "of this host's 24.0 GiB" in crowded
    assert "kill a core" in crowded and "dataplane.slot_memory_mb = 10240" in crowded
    with pytest.raises(ConfigError) as refused:
        slot_memory_verdict(config(100_000), host)
    text = str(refused.value)
    assert text.startswith("appliance.toml: dataplane.slot_memory_mb = 100000 maps 98.1 GiB")
    assert "for the 2 cores: more than this host's 24.0 GiB" in text
    assert slot_memory_verdict(config(100_000), None) is None  # not told: not refused


def test_the_hosts_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:        1000 kB\n")
    assert host_memory_bytes(meminfo) == 24576000 * 1024
    meminfo.write_text("nothing useful\n")
    assert host_memory_bytes(meminfo) is None
    assert host_memory_bytes(tmp_path / "absent") is None


def pinned(cpus: list[int], cores: int | None = None, poll: str = "adaptive"):  # type: ignore[no-untyped-def]
    return parse({"dataplane": {"cpus": cpus, "cores": cores or len(cpus) or 2, "poll": poll,
                                "mtu": 9000}}, source="appliance.toml")


def test_a_cpu_no_thread_can_be_pinned_to_is_refused_in_the_configs_terms() -> None:
    """A core pinned to a CPU the host lacks died at its start with a traceback ending in
    sched_setaffinity's bare EINVAL, and the daemon said "core 1 died while starting"."""
    absent = (os.cpu_count() or 1) + 1000
    assert unpinnable_cpus([absent]) == {absent: "not on this host, or outside its cpuset"}
    with pytest.raises(ConfigError, match=rf"appliance.toml: dataplane.cpus: no core can be "
                                          rf"pinned to CPU {absent} \(not on this host"):
        cpu_verdict(pinned([0, absent]), daemon_cpus=2)


def test_pinning_is_tried_outside_the_daemons_own_cpus_and_leaves_them_as_they_were() -> None:
    """A tuned host keeps the daemon off the cores' isolated CPUs (CPUAffinity=), which the
    cores may still pin to: the daemon's affinity is not the test."""
    mine = os.sched_getaffinity(0)
    every = sorted(os.sched_getaffinity(0) | {0})
    try:
        os.sched_setaffinity(0, {every[-1]})
        assert unpinnable_cpus(every) == {}
        assert os.sched_getaffinity(0) == {every[-1]}
    finally:
        os.sched_setaffinity(0, mine)


def test_unpinned_cores_beyond_the_daemons_cpus_are_warned_about() -> None:
    def nothing_refused(cpus: object) -> dict[int, str]:
        return {}

    assert cpu_verdict(pinned([], cores=2), daemon_cpus=2, refused=nothing_refused) is None
    assert cpu_verdict(pinned([], cores=8), daemon_cpus=None, refused=nothing_refused) is None
    assert cpu_verdict(pinned([0, 1, 2]), daemon_cpus=2, refused=nothing_refused) is None
    crowded = cpu_verdict(pinned([], cores=3), daemon_cpus=2, refused=nothing_refused)
    assert crowded == ("dataplane.cores = 3, unpinned, on the 2 CPU(s) reductiond may use: the "
                       "cores take turns on them; lower dataplane.cores, or pin them with "
                       "dataplane.cpus")
    busy = cpu_verdict(pinned([], cores=3, poll="busy"), daemon_cpus=2, refused=nothing_refused)
    assert busy is not None and "busy-polling ones never yield theirs" in busy


def test_a_cpu_listed_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dataplane.cpus: lists a CPU twice \(\[1, 1\]\)"):
        pinned([1, 1])
