"""The serials of the results a worker has heard from each appliance core (wire.py: a core
numbers its results of a job mod 256 in the order it sends them, and they reach a worker in
order), shared by the rounds of one rank as `slotplan.SendOrder` is: the newest, which a query
carries so that the core resends only a result that was lost, and the ones skipped: results
lost on their way here, until they come again. While a core has some, as many segments
overtaken there are asked after at once (plugin/overtaken.py): they may be theirs. Sans-I/O."""

from __future__ import annotations

from reduction_appliance.dataplane.wire import SERIALS

__all__ = ["ResultSerials"]


class ResultSerials:
    __slots__ = ("lost", "newest")

    def __init__(self, cores: int) -> None:
        self.newest = [-1] * cores  # -1: none heard yet
        self.lost: list[dict[int, None]] = [{} for _ in range(cores)]

    def jump(self, core: int, serial: int) -> None:
        """A result whose serial is not the next after `newest` (the caller checks that, in
        line, per result): ahead, the ones between were lost on their way; behind, a lost one
        came again."""
        newest, lost = self.newest[core], self.lost[core]
        ahead = (serial - newest) % SERIALS
        if newest < 0 or 0 < ahead < SERIALS // 2:
            self.newest[core] = serial
            if newest >= 0:
                for i in range(1, ahead):
                    lost[(newest + i) % SERIALS] = None
            # Forget gaps half the serials behind: their rounds ended some other way.
            for old in [s for s in lost if (serial - s) % SERIALS >= SERIALS // 2]:
                del lost[old]
        else:
            lost.pop(serial, None)

    def reset(self) -> None:
        """A new epoch: the cores number their results from 0 again."""
        self.newest[:] = [-1] * len(self.newest)
        for lost in self.lost:
            lost.clear()
