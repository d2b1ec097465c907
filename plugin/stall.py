"""What a round that missed its deadline says: which cores left how many segments unanswered,
and, where a core's last PENDING told, which ranks it still waits for. An operator reads this
first when training hangs, so it names the ranks to look at. Sans-I/O: plain values in, text
out (the round gathers them, `AllreduceTimeout` carries the text)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["CoreStall", "stall_report"]

_RANKS_SHOWN = 16  # a rack's worth; beyond it the list would bury the rest of the message


class CoreStall(NamedTuple):
    name: str  # the core as the operator knows it (appliance address and core number)
    unanswered: int  # segments of the round it left unanswered
    waits_for: Sequence[int] | None  # ranks its last PENDING lacked; None: it sent none


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
        f"{what} missed its {deadline_s:g} s deadline after {elapsed_s:.1f} s: {remaining} of "
        f"{segments} segments unanswered; no answer from " + ", ".join(parts)
    )


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:_RANKS_SHOWN])
    return f"[{shown}{', ...' if len(ranks) > _RANKS_SHOWN else ''}]"
