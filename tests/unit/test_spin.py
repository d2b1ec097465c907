"""The adaptive poll mode's spin window and idle blocks (dataplane/spin.py), driven with idle
periods' lengths, and the core loop that feeds them."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.loop import CoreLoop
from reduction_appliance.dataplane.spec import CoreConfig, QueryStats, Request, Stop
from reduction_appliance.dataplane.spin import DEEP_IDLE_S, GROW_START_S, IdleBlocks, SpinWindow
from reduction_appliance.dataplane.transport import MemoryCoreTransport, MemoryNetwork
from tests.waiting import wait_until

LIMIT = 200e-6


def test_it_starts_at_the_limit_as_a_fixed_spin_would() -> None:
    assert SpinWindow(LIMIT).window_s == LIMIT


def test_periods_the_spin_caught_leave_it_alone() -> None:
    spin = SpinWindow(LIMIT)
    for idle in (0.0, 10e-6, LIMIT):
        spin.idle_ended(idle)
    assert spin.window_s == LIMIT and spin.grown == spin.shrunk == 0


def test_periods_longer_than_any_spin_halve_it_down_to_zero() -> None:
    spin = SpinWindow(LIMIT)
    seen = []
    for _ in range(5):
        spin.idle_ended(2e-3)
        seen.append(spin.window_s)
    # 200 -> 100 -> 50 -> 25 -> 12.5, below the first step: zero, and it stays there
    assert seen == pytest.approx([100e-6, 50e-6, 25e-6, 0.0, 0.0])
    assert spin.shrunk == 4


def test_a_short_gap_after_silence_starts_it_again_and_it_doubles_to_the_limit() -> None:
    spin = SpinWindow(LIMIT)
    for _ in range(5):
        spin.idle_ended(1.0)
    assert spin.window_s == 0.0
    seen = []
    for _ in range(6):
        spin.idle_ended(150e-6)  # a longer spin would have caught it
        seen.append(spin.window_s)
    assert seen == pytest.approx([GROW_START_S, 50e-6, 100e-6, 200e-6, 200e-6, 200e-6])
    assert spin.grown == 4  # the last two were caught by the spin


def test_a_spin_limit_of_zero_never_spins() -> None:
    spin = SpinWindow(0.0)
    for idle in (0.0, 1e-6, 1.0):
        spin.idle_ended(idle)
        assert spin.window_s == 0.0


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 0"):
        SpinWindow(-1e-6)


@given(limit=st.floats(0.0, 1e-3), idles=st.lists(st.floats(0.0, 1e-2), max_size=60))
def test_the_window_stays_between_zero_and_the_limit(limit: float, idles: list[float]) -> None:
    spin = SpinWindow(limit)
    for idle in idles:
        before = spin.window_s
        spin.idle_ended(idle)
        assert 0.0 <= spin.window_s <= limit
        if idle <= before:
            assert spin.window_s == before  # caught: unchanged
        elif idle <= limit:
            assert spin.window_s > before  # would have been caught by a longer one: grows
        else:
            assert spin.window_s < before or before == 0.0  # none could: shrinks


def test_blocks_double_to_the_transports_ceiling_while_the_spell_is_young() -> None:
    blocks = IdleBlocks(50e-6, 2e-3, 50e-3)
    seen = [blocks.block_s]
    idle = 0.0
    for _ in range(8):
        idle += blocks.block_s
        blocks.blocked(idle)
        seen.append(blocks.block_s)
    assert seen == pytest.approx([50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 2e-3, 2e-3,
                                  2e-3])


def test_a_long_spell_blocks_up_to_the_deep_ceiling_and_work_starts_short_again() -> None:
    blocks = IdleBlocks(50e-6, 2e-3, 50e-3)
    for _ in range(20):
        blocks.blocked(DEEP_IDLE_S - 1e-3)
    assert blocks.block_s == 2e-3  # seconds of silence, but not yet DEEP_IDLE_S
    seen = []
    for _ in range(6):
        blocks.blocked(DEEP_IDLE_S)
        seen.append(blocks.block_s)
    assert seen == pytest.approx([4e-3, 8e-3, 16e-3, 32e-3, 50e-3, 50e-3])
    blocks.restart()
    assert blocks.block_s == 50e-6


def test_blocks_out_of_order_are_refused() -> None:
    for first, longest, deep in ((0.0, 1e-3, 1e-2), (2e-3, 1e-3, 1e-2), (1e-4, 1e-2, 1e-3)):
        with pytest.raises(ValueError, match="blocks need"):
            IdleBlocks(first, longest, deep)


@given(idles=st.lists(st.floats(0.0, 2 * DEEP_IDLE_S), max_size=60))
def test_a_block_stays_between_first_and_its_ceiling(idles: list[float]) -> None:
    blocks = IdleBlocks(50e-6, 2e-3, 50e-3)
    for idle in sorted(idles):  # one spell: idle time only grows
        blocks.blocked(idle)
        assert 50e-6 <= blocks.block_s <= (2e-3 if idle < DEEP_IDLE_S else 50e-3)


def test_the_core_loop_tells_its_window_how_long_it_was_idle() -> None:
    """The real poll loop, in a thread, over the in-memory transport (whose descriptor wakes
    its select): a spin limit of 1 us is outlasted by any real idle period, so the datagram
    that ends the loop's first one must halve the window, to zero."""
    net = MemoryNetwork()
    core = ("198.18.0.1", 7000)
    cfg = CoreConfig(index=0, cpu=None, bind=core, max_payload=1024, slot_capacity=16,
                     rx_buffers=64, kernels="numpy", spin_us=1)
    ours, theirs = Pipe()
    loop = CoreLoop(cfg, theirs, Counters(), MemoryCoreTransport(net.bind(core)))
    runner = threading.Thread(target=loop.run, name="core-loop", daemon=True)
    runner.start()
    try:
        ours.send(Request(1, QueryStats(())))  # answered: the loop runs, and found nothing
        assert ours.poll(10.0), "the core loop did not answer its mailbox"
        assert ours.recv().error is None
        net.transmit(("198.18.0.101", 40000), core, b"not a datagram of ours")
        net.advance(net.next_arrival())
        wait_until(lambda: loop.counters[Counter.PACKETS_IN], 10.0,
                   what="the core loop to take the datagram")
    finally:
        ours.send(Request(2, Stop()))
        runner.join(10.0)
        assert not runner.is_alive(), "the core loop did not stop"
        loop.close()
        ours.close()
        theirs.close()
    assert loop.spin.shrunk == 1 and loop.spin.window_s == 0.0
