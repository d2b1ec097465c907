"""A data-plane core serving UDP and RoCE at once: its UDP socket and its RoCE queue pairs
(`dataplane.roce.RoceCoreTransport`) behind the one `CoreTransport` seam."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .transport import Address, RxBatch, Send, TransportCounts

if TYPE_CHECKING:
    from .roce import RoceCoreTransport

__all__ = ["DualCoreTransport"]


class DualCoreTransport:
    """A core's UDP socket and its RoCE queue pairs as one `CoreTransport`: a send goes over
    RoCE when its destination is a connected queue pair's address (ports in `ROCE_PORTS`),
    else over UDP."""

    def __init__(self, udp: Any, roce: RoceCoreTransport) -> None:
        self.udp = udp
        self.roce = roce
        self.idle_block_s = roce.idle_block_s
        self._roce_first = True

    def fileno(self) -> int:
        return int(self.udp.fileno())

    def receive(self, pool: Any, batch: RxBatch, limit: int) -> int:
        # One half per call (each fills the batch afresh), taking turns so that neither can
        # starve the other; the other half is tried at once when the first has nothing.
        first, second = (self.roce, self.udp) if self._roce_first else (self.udp, self.roce)
        self._roce_first = not self._roce_first
        got = int(first.receive(pool, batch, limit))
        if got or batch.truncated:
            return got
        return int(second.receive(pool, batch, limit))

    def send(self, sends: Sequence[Send]) -> None:
        served = self.roce.serves
        roce = [s for s in sends if served(s.dest)]
        if roce:
            self.roce.send(roce)
            if len(roce) < len(sends):
                self.udp.send([s for s in sends if not served(s.dest)])
        else:
            self.udp.send(sends)

    def take_counts(self) -> TransportCounts:
        a, b = self.udp.take_counts(), self.roce.take_counts()
        return TransportCounts(a.datagrams_sent + b.datagrams_sent, a.bytes_sent + b.bytes_sent,
                               a.send_errors + b.send_errors)

    def fallbacks(self) -> tuple[str, ...]:
        return tuple(self.udp.fallbacks())

    def closed_ports(self) -> list[Address] | None:
        """The UDP half's, but never a queue pair's address: a notice to one whose queue pair
        is gone leaves over UDP, and what its host answers says nothing of its process."""
        from .roce import ROCE_PORTS  # (pyverbs: only where a core serves RoCE)

        closed: list[Address] | None = self.udp.closed_ports()
        return closed and [a for a in closed if a[1] not in ROCE_PORTS]

    def close(self) -> None:
        """Both halves, and the RDMA device (this transport owns it)."""
        try:
            self.roce.close()
            self.roce.device.close()
        finally:
            self.udp.close()
