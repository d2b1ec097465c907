"""What a round that had no result for its deadline says: which cores left how many segments
unanswered, and, where a core's last PENDING told, which ranks it still waits for. An operator
reads this first when training hangs, so it names the ranks to look at. Sans-I/O: plain values
in, text out (the round gathers them, `AllreduceTimeout` carries the text). And what an
appliance's answer naming silent ranks says (`rank_verdict`): `RankSilent`, `RankEnded` or
`RankLeft`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from reduction_appliance.dataplane.errors import RankEnded, RankLeft, RankSilent
from reduction_appliance.dataplane.units import format_ranks
from reduction_appliance.dataplane.wire import SilentRank

__all__ = ["CoreStall", "rank_verdict", "stall_report", "stalled_cores"]

_RANKS_SHOWN = 16  # a rack's worth; beyond it the list would bury the rest of the message
_NAMED = 8  # silent ranks named with their endpoints; the rest by number


class CoreStall(NamedTuple):
    name: str  # the core as the operator knows it (appliance address and core number)
    unanswered: int  # segments of the round it left unanswered
    waits_for: Sequence[int] | None  # ranks its last PENDING lacked; None: it sent none


def stalled_cores(names: Sequence[str], done: bytes | bytearray,
                  pending: dict[int, bytes], world_size: int) -> list[CoreStall]:
    """The cores that left segments unanswered: segment k went to core k mod len(`names`)
    and is answered where `done[k]`; `pending` holds each core's last PENDING bitmap."""
    cores = len(names)
    waiting = [0] * cores
    for k, answered in enumerate(done):
        if not answered:
            waiting[k % cores] += 1
    stalled = []
    for e, count in enumerate(waiting):
        if count:
            waits_for = None  # it sent no PENDING
            if (bitmap := pending.get(e)) is not None:
                have = int.from_bytes(bitmap, "little")
                waits_for = [r for r in range(world_size) if not have >> r & 1]
            stalled.append(CoreStall(names[e], count, waits_for))
    return stalled


def stall_report(what: str, deadline_s: float, elapsed_s: float, remaining: int,
                 segments: int, cores: Sequence[CoreStall]) -> str:
    """`what` names the round ("allreduce round 3 of ... by rank 1"); `cores` are the ones that
    left segments unanswered, in the order to show."""
    parts = []
    for core in cores:
        plural = "s" if core.unanswered != 1 else ""
        text = f"{core.name} ({core.unanswered} segment{plural} unanswered"
        if core.waits_for is not None:
            text += f"; it still waits for ranks {_ranks(core.waits_for)}"
        parts.append(text + ")")
    return (
        f"{what} had no result for its deadline, {deadline_s:g} s ({elapsed_s:.1f} s in all): "
        f"{remaining} of {segments} segments unanswered; no answer from " + ", ".join(parts)
    )


def _ranks(ranks: Sequence[int]) -> str:
    return f"[{format_ranks(ranks, _RANKS_SHOWN)}]"


def rank_verdict(dead: list[SilentRank], job_id: int, liveness_timeout: float,
                 unnamed: int = 0) -> RankSilent:
    """What a LIVENESS answer naming `dead` means for this rank's rounds. A rank that left (its
    worker said so) is not a crash: its peers made more all_reduce calls than it did.
    `unnamed`: how many more ranks the appliance counts silent than the answer names
    (wire.SILENT_RECORDS): it names the most telling first, so the ranks it cut off are like
    the last it named, or less telling."""
    def named(ranks: list[SilentRank]) -> str:
        shown = "; ".join(f"rank {s.rank} ({s.address[0]}:{s.address[1]})" if s.address
                          else f"rank {s.rank}" for s in ranks[:_NAMED])
        rest = ranks[_NAMED:]
        cut = unnamed if ranks[-1] is dead[-1] else 0  # (the list the answer was cut in)
        if not rest and not cut:
            return shown
        listed = format_ranks(s.rank for s in rest) + (", ..." if cut else "") \
            if rest else "not named"
        return f"{shown}; and {len(rest) + cut} more ({listed})"

    ended = [s for s in dead if s.closed]
    if ended:
        return RankEnded(
            f"{named(ended)} ended without leaving job {job_id}: nothing came from it for "
            f"{max(s.silent_s for s in ended):.1f} s, and its host answers that nothing "
            "listens at its endpoint any more (its process was killed, by the OOM killer or a "
            "scheduler, crashed, or exited, or its client was closed without leaving); this "
            "rank's allreduce cannot finish without it "
            "(a restarted rank re-joins)")
    gone = [s for s in dead if not s.left]
    if gone:
        return RankSilent(
            f"{named(gone)} silent for {max(s.silent_s for s in gone):.1f} s (liveness timeout "
            f"{liveness_timeout:g} s): its worker died, or its host or network is gone; job "
            f"{job_id} cannot finish an allreduce without it (a restarted rank re-joins)")
    return RankLeft(
        f"{named(dead)} left job {job_id} {max(s.silent_s for s in dead):.1f} s ago (it "
        "closed its process group or client and left) while this rank's allreduce waits for "
        "it: it was stopped (an exception, Ctrl-C) before that allreduce, or the ranks made "
        "different numbers of allreduce calls (uneven inputs across ranks? DDP's join() "
        "context manager evens them out)")
