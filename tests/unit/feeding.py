"""Hand datagrams (real bytes) to an aggregator the way a transport does: into a receive-pool
buffer, recorded in an RxBatch."""

from __future__ import annotations

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.transport import Address, RxBatch, Send


def feed(agg: Aggregator, datagrams: list[tuple[bytes, Address]],
         now: float = 0.0) -> list[Send]:
    """Deliver `datagrams` as one batch; the decisions for all of them."""
    batch = RxBatch()
    pool = agg.pool
    for datagram, source in datagrams:
        index = pool.take()
        assert index is not None, "receive pool exhausted"
        pool.views[index][:len(datagram)] = datagram
        batch.add(index, len(datagram), source)
    return agg.on_batch(batch, now)
