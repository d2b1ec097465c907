"""A worker that hears none of its job's multicast results says so (plugin.multicast_watch)."""

from __future__ import annotations

from reduction_appliance.plugin.multicast_watch import UNHEARD_ROUNDS, MulticastWatch


def test_rounds_repaired_without_a_datagram_on_the_group_are_named_once() -> None:
    watch = MulticastWatch(1, [("239.255.0.1", 7100), ("239.255.0.1", 7100)], "198.18.0.102")
    assert watch.round_ended(heard_on_groups=40, retransmissions=0) is None  # heard: fine
    said = [watch.round_ended(40, retransmissions=7) for _ in range(UNHEARD_ROUNDS)]
    assert said[:-1] == [None] * (UNHEARD_ROUNDS - 1)
    assert said[-1] is not None
    assert said[-1].startswith(f"rank 1: the last {UNHEARD_ROUNDS} allreduces heard none of "
                               "their results on the job's multicast group 239.255.0.1:7100: ")
    assert "IGMP snooping and no querier" in said[-1] and "multicast.enabled = false" in said[-1]
    assert "REDUCTION_LOCAL_ADDRESS" not in said[-1]  # it joined on the address it was given
    assert watch.round_ended(40, retransmissions=7) is None  # once
    assert watch.said


def test_a_round_that_heard_the_group_or_needed_no_repair_breaks_the_streak() -> None:
    watch = MulticastWatch(0, [("239.255.0.2", 7000)], "198.18.0.101")
    heard = 0
    for _ in range(10):
        for _ in range(UNHEARD_ROUNDS - 1):
            assert watch.round_ended(heard, retransmissions=1) is None  # a lost multicast each
        heard += 1  # the next round heard the group
        assert watch.round_ended(heard, retransmissions=1) is None
    for _ in range(10):  # rounds ending together (lanes): the later ones needed no repair
        assert watch.round_ended(heard, retransmissions=0) is None
    assert not watch.said


def test_a_worker_given_no_local_address_is_pointed_at_it() -> None:
    """A host with a management network joins the group on the interface its default route
    names when no address is given: the data network never hears the join."""
    watch = MulticastWatch(0, [("239.255.0.2", 7000)], "0.0.0.0")
    said = [watch.round_ended(0, retransmissions=3) for _ in range(UNHEARD_ROUNDS)][-1]
    assert said is not None and ("or this host joined the group on another interface than the "
                                 "data network's (no local address was given: set "
                                 "REDUCTION_LOCAL_ADDRESS") in said


def test_a_group_that_brings_only_each_rounds_short_last_segment_is_named() -> None:
    """A multicast route narrower than the unicast path (or a firewall rule on length): the
    group brings a round's last segment, shorter than the rest, and nothing else. Every 1 MB
    call once took 2 s instead of 10 ms on the emulated rack, and nothing was said."""
    watch = MulticastWatch(2, [("239.255.0.3", 7000)], "198.18.0.103")
    said = [watch.round_ended(heard, retransmissions=208, segments=118)  # 1 of 118 heard
            for heard in range(1, UNHEARD_ROUNDS + 1)]
    assert said[:-1] == [None] * (UNHEARD_ROUNDS - 1) and said[-1] is not None
    assert said[-1].startswith(f"rank 2: the last {UNHEARD_ROUNDS} allreduces heard few of "
                               "their results on the job's multicast group 239.255.0.3:7000")
    assert "or not its full-size datagrams (a multicast route narrower than" in said[-1]


def test_a_group_that_brings_most_results_is_fine_whatever_was_repaired() -> None:
    watch = MulticastWatch(0, [("239.255.0.3", 7000)], "198.18.0.101")
    heard = 0
    for _ in range(10):
        heard += 100  # at 15% loss, 100 of 118 on the group; the rest asked for again
        assert watch.round_ended(heard, retransmissions=40, segments=118) is None
    for _ in range(10):  # a few results heard, but hardly anything repaired (lanes' rounds
        heard += 1       # whose results a sibling round's count took): no verdict
        assert watch.round_ended(heard, retransmissions=3, segments=118) is None
    assert not watch.said
