"""What a round that missed its deadline says: which cores left how many segments unanswered,
and, where a core's last PENDING told, which ranks it still waits for. An operator reads this
first when training hangs, so it names the ranks to look at. Sans-I/O: plain values in, text
out (the round gathers them, `AllreduceTimeout` carries the text)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["stall_report"]

_RANKS_SHOWN = 16  # a rack's worth; beyond it the list would bury the rest of the message


def stall_report(what: str, deadline_s: float, elapsed_s: float, remaining: int,
                 segments: int, unanswered: Mapping[str, int],
                 lacking: Mapping[str, Sequence[int]]) -> str:
    """`what` names the round ("allreduce round 3 of ... by rank 1"); `unanswered` counts the
    segments each core (by name, in the order to show) left unanswered; `lacking` lists, for
    the cores whose PENDING said so, the ranks they still wait for."""
    parts = []
    for core, count in unanswered.items():
        text = f"{core} ({count} segment{'s' if count != 1 else ''} unanswered"
        if core in lacking:
            text += f"; it still waits for ranks {_ranks(lacking[core])}"
        parts.append(text + ")")
    return (
        f"{what} missed its {deadline_s:g} s deadline after {elapsed_s:.1f} s: {remaining} of "
        f"{segments} segments unanswered; no answer from " + ", ".join(parts)
    )


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:_RANKS_SHOWN])
    return f"[{shown}{', ...' if len(ranks) > _RANKS_SHOWN else ''}]"
