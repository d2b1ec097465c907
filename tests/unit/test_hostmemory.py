"""The cores' memory against the host's, said in the operator's terms before the cores start
(a core once died at its start with a bare ENOMEM, or later, killed mid-training)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.hostmemory import host_memory_bytes, slot_memory_verdict
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
