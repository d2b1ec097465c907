"""Fallbacks (what the appliance gives up on a host, and why): each logged once whichever core
reports it, shown by status, and decided where it happens: the kernel choice, a refused GSO,
an unroutable multicast range."""

from __future__ import annotations

import logging
from multiprocessing import Pipe

import pytest

from reduction_appliance.control import daemon, steering
from reduction_appliance.control.config import parse
from reduction_appliance.control.ctl import render_status
from reduction_appliance.control.fallbacks import Fallbacks
from reduction_appliance.control.registry import JobRequest, Registry
from reduction_appliance.dataplane import reduce
from reduction_appliance.dataplane.counters import Counters
from reduction_appliance.dataplane.loop import CoreLoop
from reduction_appliance.dataplane.spec import CoreConfig, CoreStats, QueryStats, Request
from reduction_appliance.dataplane.transport import MemoryCoreTransport, MemoryNetwork

CORE = ("198.18.0.1", 7000)


def test_a_fallback_is_logged_once_whichever_core_reports_it(
        caplog: pytest.LogCaptureFixture) -> None:
    fallbacks = Fallbacks()
    with caplog.at_level(logging.INFO, logger="reductiond"):
        for _ in range(3):  # every probe of every core says it again
            fallbacks.note("reduce kernels numpy, not torch (why)", core=1)
            fallbacks.note("reduce kernels numpy, not torch (why)", core=0)
        fallbacks.note("results by unicast fan-out (no route)")
    assert [r.getMessage() for r in caplog.records] == [
        "fallback (core 1): reduce kernels numpy, not torch (why)",
        "fallback: results by unicast fan-out (no route)"]
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert fallbacks.describe() == ("reduce kernels numpy, not torch (why) (cores 0, 1)",
                                    "results by unicast fan-out (no route)")


def torch_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    real = reduce._why_not
    monkeypatch.setattr(reduce, "_why_not", lambda name: "ImportError: libtorch.so: missing"
                        if name == "torch" else real(name))


def test_the_kernel_choice_names_what_it_passed_over_and_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch_cannot_load(monkeypatch)
    chosen = reduce.select_kernels()
    assert chosen.backend != "torch"
    assert chosen.passed_over[0] == "torch (ImportError: libtorch.so: missing)"
    assert reduce.select_kernels("numpy").passed_over == ()  # chosen by the operator: no fallback


def test_a_core_reports_its_fallbacks_when_ready_and_in_every_stats_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch_cannot_load(monkeypatch)
    net = MemoryNetwork()
    _, theirs = Pipe()
    cfg = CoreConfig(index=0, cpu=None, bind=CORE, max_payload=1024, slot_capacity=16,
                     rx_buffers=64)  # kernels None: the best available
    loop = CoreLoop(cfg, theirs, Counters(), MemoryCoreTransport(net.bind(CORE)),
                    clock=net.clock)
    try:
        said = loop.fallbacks()
        assert len(said) == 1 and said[0].startswith(f"reduce kernels {loop.kernels.backend}, "
                                                     "not torch (ImportError: libtorch.so")
        stats = loop.serve(Request(1, QueryStats(()))).value
        assert isinstance(stats, CoreStats) and stats.fallbacks == said
    finally:
        loop.close()


def test_an_unroutable_multicast_range_makes_every_job_unicast(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse({"dataplane": {"address": "0.0.0.0"}})
    monkeypatch.setattr(steering, "multicast_unroutable",
                        lambda source, interface, groups: f"no route from {source} to {groups}")
    fallbacks = Fallbacks()
    usable = daemon._multicast_usable(cfg, fallbacks)
    assert not usable
    assert fallbacks.describe() == ("results by unicast fan-out to each rank, not multicast: "
                                    "no route from 0.0.0.0 to 239.255.0.0/16",)
    plan = Registry(cfg, multicast=usable).plan(JobRequest("j", 2), cookie=1, secret="s",
                                                 now=0.0)
    assert plan.spec.multicast is None  # the job asked for multicast (the default)
    routed = Registry(cfg).plan(JobRequest("j", 2), cookie=1, secret="s", now=0.0)
    assert routed.spec.multicast is not None


def test_multicast_disabled_in_the_config_is_a_choice_not_a_fallback() -> None:
    fallbacks = Fallbacks()
    assert not daemon._multicast_usable(parse({"multicast": {"enabled": False}}), fallbacks)
    assert fallbacks.describe() == ()


def test_status_lists_the_fallbacks() -> None:
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "jobs": [], "interfaces": [], "steering": [], "steering_notes": [],
                "rdma_devices": []}
    assert render_status(snapshot).endswith("\nfallbacks: none")
    shown = render_status(snapshot | {"fallbacks": ["UDP GSO refused (EIO) (core 0)"]})
    assert shown.endswith("\nfallbacks:\n  - UDP GSO refused (EIO) (core 0)")
