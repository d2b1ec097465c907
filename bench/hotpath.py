"""The data path's Python per datagram, in memory: no network, no kernel, little noise.

    python -m reduction_appliance.bench.hotpath [--repeat 5]

On the emulated rack at n = 8 two cores run nine Python processes, and the interpreter is most
of what they spend (docs/benchmarks-journal.md, "Where the CPU goes at n = 8"), so the Python
each segment costs is what a change to the hot path should move. Three measurements, each the best
of `--repeat` runs (the best is the least disturbed by the machine; runs move by 30% here):

* worker: `ApplianceClient.allreduce` of 64 MiB fp32 through `UdpWorkerTransport`'s own send and
  receive code, over a stand-in socket that answers every contribution with its result, ten
  results per wakeup in coalesced (GRO) batches of seven: the shape of a worker's turns on the
  rack at n = 8 (about 10.7 results per turn). The stand-in's own time is subtracted. The
  congestion windows run as the appliance advises by default (`jobs.queue_target_s`), and as
  at n = 8 a peer completes seven results of eight, none of them queued.
  Microseconds per segment, both directions (one contribution sent, one result taken in).
  Then the same with one result per wakeup: from the two, what a turn costs of its own (its
  wait's wakeup, the timers and window asked, the sends' setup), apart from the segments.
* appliance: `Aggregator.on_batch` taking 64 MiB from each of 8 ranks in coalesced receives of
  seven of one rank's segments, left in a staging buffer as a UDP GRO receive leaves them (the
  burst path, `dataplane.runs`), the reduce kernels included. Microseconds per datagram; then
  the same in fp16 and bf16 (accumulated in fp32: widened on the way in, narrowed on the way
  out).
* per byte with wider segments: both again with segments of seven datagrams' payload (62272 B,
  one per coalesced receive, as loopback's 64 KB path carries them), per 8896 B. The Python's
  cost is mostly per segment, not per byte. An upper bound on what bookkeeping per GSO send
  (on the rack the kernel already moves a GSO send, and a GRO receive, as one) would save: here
  each datagram's own header and copy, and each turn's cost, are spread over 62 KB as well.

Compare trees by running the command in each, interleaved, and reading the best figures.
"""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from reduction_appliance.control.config import JobDefaults
from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.registration import EndpointInfo
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import RxBatch, Staging
from reduction_appliance.dataplane.udp import GRO_BUFFER, UDP_GRO
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    SERIALS,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
    unpack,
)
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import JobInfo
from reduction_appliance.plugin.transport import UdpWorkerTransport

from .gauge import framing, interpreter_ms

__all__ = ["appliance_us_per_datagram", "main", "worker_us_per_segment"]

SEGMENT = 8896  # the rack's payload at MTU 9000
NBYTES = 64 * 2**20
RANKS = 8
SLOTS = 32
PER_WAKEUP = 10  # results a worker finds per turn on the rack at n = 8
GRO_BATCH = 7  # datagrams per coalesced receive on the rack's veth
GRO_BYTES = GRO_BATCH * (HEADER_SIZE + SEGMENT)  # what one coalesced receive holds
# A segment of seven datagrams' payload: one 64 KB coalesced receive per segment, the Python's
# cost per byte if a segment's bookkeeping spanned a GSO send's datagrams (loopback's segment)
WIDE_SEGMENT = GRO_BATCH * SEGMENT
CORES = (("198.18.0.1", 7000), ("198.18.0.1", 7001))


class _Answering:
    """A stand-in for the worker's socket: every contribution (or query) sent is answered with
    its RESULT, up to `PER_WAKEUP` per wakeup, in coalesced batches from one core. Its own time
    goes to `spent`."""

    def __init__(self, gro_batch: int = GRO_BATCH) -> None:
        self.gro_batch = gro_batch
        self.queue: collections.deque[tuple[Header, bytes, tuple[str, int]]] = collections.deque()
        self.budget = 0
        self.spent = 0.0

    def sendmsg(self, iov: list[Any], ancdata: Any, flags: int, dest: tuple[str, int]) -> int:
        start = time.perf_counter()
        sent = 0
        for header, payload in zip(iov[::2], iov[1::2], strict=True):
            h = unpack(bytes(header))
            body = bytes(payload) if h.kind is Kind.CONTRIBUTION else bytes(h.length)
            # The rank whose contribution completed it: a peer's, but for one result in RANKS.
            completer = h.rank if h.serial % RANKS == 0 else (h.rank + 1) % RANKS
            self.queue.append((h._replace(kind=Kind.RESULT, flags=Flags.NONE, rank=completer),
                               body, dest))
            sent += len(header) + len(payload)
        self.spent += time.perf_counter() - start
        return sent

    def recvmsg_into(self, buffers: list[bytearray], ancbufsize: int,
                     flags: int) -> tuple[int, list[tuple[int, int, bytes]], int, Any]:
        start = time.perf_counter()
        try:
            if not self.budget or not self.queue:
                raise BlockingIOError
            buf, at, count, source = buffers[0], 0, 0, self.queue[0][2]
            size, most = HEADER_SIZE + len(self.queue[0][1]), self.gro_batch
            while self.queue and self.budget and count < most and self.queue[0][2] == source:
                h, body, _ = self.queue.popleft()
                pack_into(buf, h, at)
                buf[at + HEADER_SIZE:at + HEADER_SIZE + len(body)] = body
                at += HEADER_SIZE + len(body)
                self.budget -= 1
                count += 1
            gro = [(socket.SOL_UDP, UDP_GRO, size.to_bytes(4, sys.byteorder))]
            return at, gro if count > 1 else [], 0, source
        finally:
            self.spent += time.perf_counter() - start

    def close(self) -> None:
        pass


class _InMemoryTransport(UdpWorkerTransport):
    """UdpWorkerTransport's send and receive code over `_Answering`; a wait is a wakeup."""

    answering: _Answering
    per_wakeup: int

    @classmethod
    def answered_by(cls, answering: _Answering, per_wakeup: int) -> _InMemoryTransport:
        transport = cls.over([cast(socket.socket, answering)])
        transport.answering = answering
        transport.per_wakeup = per_wakeup
        return transport

    def wait(self, timeout: float | None, wake: socket.socket | None = None) -> None:
        self.answering.budget = self.per_wakeup

    def fragmenting_routes(self, dests: Sequence[tuple[str, int]],
                           payload_bytes: int) -> list[str]:
        return []  # no routes in memory

    @property
    def receive_buffer(self) -> int:
        return 64 << 20  # a tuned host's: the windows stay the slots


def _per_receive(segment: int) -> int:
    """Datagrams of `segment` payload bytes that one coalesced receive holds (at least one)."""
    return max(1, GRO_BYTES // (HEADER_SIZE + segment))


def worker_us_per_segment(per_wakeup: int = PER_WAKEUP, segment: int = SEGMENT) -> float:
    """One 64 MiB allreduce by a worker against the answering stand-in, `per_wakeup` results
    per turn, `segment` payload bytes per datagram (coalesced up to `GRO_BYTES` a receive): us
    per segment."""
    answering = _Answering(_per_receive(segment))
    job = JobInfo("bench", 5, "hotpath", RANKS, segment, None, False, 60.0,
                  tuple(EndpointInfo(i, host, port, SLOTS) for i, (host, port) in enumerate(CORES)),
                  cookie=77, queue_target_s=JobDefaults.queue_target_s)
    array = np.ones(NBYTES // 4, np.float32)
    transport = _InMemoryTransport.answered_by(answering, per_wakeup)
    with ApplianceClient([job], 0, transport=transport, lease=False, probe_path=False) as c:
        start = time.perf_counter()
        c.allreduce(array)
        spent = time.perf_counter() - start - answering.spent
    if not np.all(array == 1):  # each result is the contribution itself
        raise RuntimeError("the in-memory allreduce came back wrong: the bench is broken")
    return spent / -(-NBYTES // segment) * 1e6


def appliance_us_per_datagram(dtype: DType = DType.FLOAT32, segment: int = SEGMENT) -> float:
    """8 ranks' 64 MiB of `dtype` through one appliance core's aggregator, `segment` payload
    bytes per datagram (coalesced up to `GRO_BYTES` a receive): us per datagram."""
    segments = -(-NBYTES // segment) // len(CORES)  # one core's share
    per_receive = _per_receive(segment)
    where = [(f"198.18.0.{101 + r}", 9000) for r in range(RANKS)]
    with SlotArena(capacity=SLOTS, max_payload=segment,
                   rx_buffers=4096 * SEGMENT // segment) as arena:
        agg = Aggregator(arena, select_kernels(), Counters())
        agg.add_job(JobSpec(5, 77, RANKS, SLOTS, False, ("239.255.0.9", 7100), epoch=1,
                            endpoints=tuple(where), hold_buffers=0), 0.0)
        size = HEADER_SIZE + segment
        staging = Staging(GRO_BUFFER)
        payload = _ones(dtype, segment)
        batch, spent, count = RxBatch(), 0.0, 0
        for window in range(0, segments, SLOTS):  # every rank sends its window, then the next
            last = min(window + SLOTS, segments)
            for rank in range(RANKS):
                for first in range(window, last, per_receive):
                    batch.clear()
                    at = 0
                    for k in range(first, min(first + per_receive, last)):
                        pack_into(staging.buffer, Header(
                            Kind.CONTRIBUTION, dtype, Op.SUM, 0, 5, rank, 77, 1,
                            k % SLOTS, k * segment, segment, k // SLOTS + 1, 1,
                            k % SERIALS), at)  # numbered, as a worker numbers its sends
                        staging.buffer[at + HEADER_SIZE:at + size] = payload
                        at += size
                    batch.add_run(staging, at, size, where[rank])  # as a GRO receive leaves it
                    start = time.perf_counter()
                    agg.on_batch(batch, 0.0)
                    spent += time.perf_counter() - start
                    count += batch.count
        if agg.counters[Counter.DECLINED_DATAGRAMS]:
            raise RuntimeError("the burst path declined a regular run: the bench is broken")
        return spent / count * 1e6


def _ones(dtype: DType, nbytes: int) -> bytes:
    """A segment of 1.0s in `dtype`'s wire bits (bf16's 1.0 is fp32's top half)."""
    one = np.ones(1, np.float32)
    bits = {DType.FLOAT32: one.view(np.uint8),
            DType.FLOAT16: one.astype(np.float16).view(np.uint8),
            DType.BFLOAT16: one.view(np.uint16)[1:].view(np.uint8)}[dtype]
    return np.tile(bits, nbytes // len(bits)).tobytes()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.hotpath",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each; the best is shown")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    before = interpreter_ms()
    worker = [worker_us_per_segment() for _ in range(args.repeat)]
    alone = [worker_us_per_segment(1) for _ in range(args.repeat)]
    # t(w) = segment + turn / w at w results per turn: two turn shapes give both parts.
    turn = (min(alone) - min(worker)) / (1 - 1 / PER_WAKEUP)
    appliance = [appliance_us_per_datagram() for _ in range(args.repeat)]
    halves = {d: [appliance_us_per_datagram(d) for _ in range(args.repeat)]
              for d in (DType.FLOAT16, DType.BFLOAT16)}
    wide_worker = [worker_us_per_segment(segment=WIDE_SEGMENT) for _ in range(args.repeat)]
    wide_appliance = [appliance_us_per_datagram(segment=WIDE_SEGMENT)
                      for _ in range(args.repeat)]
    print(framing(before, interpreter_ms()))
    print(f"worker:    {min(worker):.2f} us of Python per segment (sent and answered); "
          f"runs {', '.join(f'{w:.2f}' for w in worker)}")
    print(f"  of which a turn's own: {turn:.1f} us per turn, {turn / PER_WAKEUP:.2f} us per "
          f"segment at {PER_WAKEUP} per turn (with one result per turn: "
          f"{min(alone):.2f} us per segment; runs {', '.join(f'{w:.2f}' for w in alone)})")
    print(f"appliance: {min(appliance):.2f} us per datagram (reduce included); "
          f"runs {', '.join(f'{a:.2f}' for a in appliance)}")
    for d, runs in halves.items():  # accumulated in fp32: widened on the way in, narrowed out
        print(f"  {d.name.lower()}: {min(runs):.2f} us per datagram; "
              f"runs {', '.join(f'{a:.2f}' for a in runs)}")
    # What the Python would cost per byte if one segment's bookkeeping covered a whole
    # coalesced receive (GSO send, GRO receive) instead of each of its datagrams.
    per = WIDE_SEGMENT // SEGMENT
    print(f"segments of {WIDE_SEGMENT} B ({per} datagrams' payload, one per receive), per "
          f"{SEGMENT} B: worker {min(wide_worker) / per:.2f} us "
          f"({min(wide_worker) / min(worker):.2f} of a segment's above: "
          f"{min(worker) * per / min(wide_worker):.1f}x less); appliance "
          f"{min(wide_appliance) / per:.2f} us "
          f"({min(appliance) * per / min(wide_appliance):.1f}x less); runs per segment: "
          f"worker {', '.join(f'{w:.2f}' for w in wide_worker)}; "
          f"appliance {', '.join(f'{a:.2f}' for a in wide_appliance)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
