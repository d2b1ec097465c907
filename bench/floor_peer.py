"""One process of `bench.floor`: the appliance's traffic with the least Python that can carry it.

    python -m reduction_appliance.bench.floor_peer appliance --bind 198.18.0.1 --workers 4 \\
        --segments 7543 --payload 8896 --iters 5
    python -m reduction_appliance.bench.floor_peer worker --bind 198.18.0.101 \\
        --appliance 198.18.0.1 --segments 7543 --payload 8896 --iters 5 --window 64

Each worker sends every segment of its array once to the appliance and takes every result
once from the multicast group; the appliance adds each segment's contributions and multicasts
the sum as soon as the last one is in. The same datagrams, the same sockets and the same kernel
paths as the appliance's data path: UDP GSO sends of up to seven datagrams, UDP GRO receives,
results by multicast, a window of segments in flight per worker. What it leaves out is all the
protocol: no slots, no loss recovery, no congestion control, no job, no bookkeeping per segment.
A batch of received datagrams is handled with a few numpy calls over a structured view of the
receive buffer, whatever its size.

So it is not an appliance. It is a bound: the time any appliance that moves these bytes through
the kernel's UDP sockets needs at least on this machine, and the CPU that the kernel alone spends
on them (bench.floor reports both).

A datagram is a header of the appliance's wire size (dataplane.wire.HEADER_SIZE) whose first
word is the segment number, then its payload. The network must be lossless: a segment lost
stops the run with an error, after `SILENCE_S` without progress (there is no recovery here).

Protocol with bench.floor on stdin and stdout, one line each: the process prints a JSON line
{"ready": true} when its sockets are open, and waits for a line on stdin; a worker then runs its
warm-up iterations, prints {"warm": true} and waits for a second line; then it runs the timed
iterations and prints {"times": [...], "ok": ..., "cpu_s": ..., "kernel_cpu_s": ...} (its own
CPU in them, and the kernel's part of that). The appliance prints {"contributions": ...} when
every contribution is in. Errors go to stderr, with exit status 1; a datagram lost, with
`LOST_EXIT` (bench.floor runs the floor again on the same network: a property of the network's
moment, not of the floor's figures).
"""

from __future__ import annotations

import argparse
import json
import resource
import select
import socket
import struct
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import numpy as np
from numpy.typing import NDArray

from reduction_appliance.dataplane.udp import UDP_GRO, UDP_SEGMENT, enlarge_buffers
from reduction_appliance.dataplane.wire import HEADER_SIZE

__all__ = ["GROUP", "PORT", "SILENCE_S", "appliance", "main", "worker"]

PORT = 7000  # the appliance's port
GROUP = ("239.255.77.77", 7001)  # the results' multicast group
_SOL_UDP = 17
_BATCH = 7  # datagrams per GSO send: the most of the rack's that fit one 64 KB send
_MAX_GSO_BYTES = 65000
_BUFFER = 65536  # one coalesced receive
_SOCKET_BUFFER = 64 << 20
SILENCE_S = 5.0  # no progress this long: a datagram was lost, and the floor cannot repair it
LOST_EXIT = 3  # the exit status that says so


def _records(payload: int) -> np.dtype[np.void]:
    """A datagram as numpy sees it: the segment number, the rest of the header, the payload."""
    return np.dtype([("segment", "<u4"), ("rest", f"V{HEADER_SIZE - 4}"),
                     ("payload", "<f4", (payload // 4,))])


def _headers(segments: int) -> memoryview:
    """Every segment's header, one after another (segment numbers; the rest zero)."""
    headers = np.zeros(segments, np.dtype([("segment", "<u4"), ("rest", f"V{HEADER_SIZE - 4}")]))
    headers["segment"] = np.arange(segments, dtype=np.uint32)
    return headers.view(np.uint8).data.cast("B")


def _bytes_of(array: NDArray[np.float32]) -> memoryview:
    return array.view(np.uint8).reshape(-1).data.cast("B")


def _segmenting(datagram: int) -> list[tuple[int, int, bytes]]:
    """A GSO send's control message (made once: it is the same for every send)."""
    return [(_SOL_UDP, UDP_SEGMENT, struct.pack("=H", datagram))]


def _batch_of(datagram: int) -> int:
    return max(1, min(_BATCH, _MAX_GSO_BYTES // datagram))


def _receiver(sock: socket.socket) -> None:
    enlarge_buffers(sock, _SOCKET_BUFFER)
    sock.setsockopt(_SOL_UDP, UDP_GRO, 1)


def _run_of(index: NDArray[np.uint32]) -> slice | None:
    """`index` as a slice when it numbers consecutive segments (the usual batch), else None.
    (In plain Python: for the few numbers of a batch, a numpy call or two costs more.)"""
    numbers = index.tolist()
    first = numbers[0]
    if numbers == list(range(first, first + len(numbers))):
        return slice(first, first + len(numbers))
    return None


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _wait_for_go() -> None:
    if not sys.stdin.readline():
        raise SystemExit("bench.floor went away before the start")


def _take(sock: socket.socket, buf: bytearray) -> int:
    """One coalesced receive, or 0 when the socket has nothing more."""
    try:
        nbytes, _, _, _ = sock.recvmsg_into([buf], 0, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0
    return nbytes


def appliance(bind: str, workers: int, segments: int, payload: int, iters: int,
              silence_s: float = SILENCE_S) -> None:
    datagram = HEADER_SIZE + payload
    records, batch, gso = _records(payload), _batch_of(datagram), _segmenting(datagram)
    sums = np.zeros((segments, payload // 4), np.float32)
    counts = np.zeros(segments, np.int64)
    headers, results = _headers(segments), _bytes_of(sums)
    buf = bytearray(_BUFFER)
    # Views over the receive buffer made once: a batch is their first k records.
    batch_view = np.frombuffer(buf, records, _BUFFER // datagram)
    numbers, payloads = batch_view["segment"], batch_view["payload"]
    expected = workers * segments * iters
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        _receiver(sock)
        sock.bind((bind, PORT))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(bind))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        # On loopback the workers share this host: the group's datagrams must loop back to them.
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, int(bind.startswith("127.")))
        _say(ready=True)
        _wait_for_go()
        taken = receives = sends = 0
        while taken < expected:
            if not select.select([sock], [], [], silence_s)[0]:
                _lost(f"appliance: {expected - taken} contributions never came")
            while nbytes := _take(sock, buf):
                k = nbytes // datagram
                receives += 1
                index = numbers[:k]
                at = _run_of(index)  # (one sender's GSO send comes back as one run)
                if at is not None:  # in place: one pass over the run's payload
                    sums[at] += payloads[:k]
                    counts[at] += 1
                    done = np.flatnonzero(counts[at] == workers) + at.start
                else:
                    index = index.astype(np.intp)
                    np.add.at(sums, index, payloads[:k])
                    np.add.at(counts, index, 1)
                    done = np.unique(index[counts[index] == workers])
                taken += k
                if not len(done):
                    continue
                counts[done] = 0
                iov: list[memoryview] = []
                for j in done.tolist():
                    iov += (headers[j * HEADER_SIZE:(j + 1) * HEADER_SIZE],
                            results[j * payload:(j + 1) * payload])
                    if len(iov) == 2 * batch:
                        sock.sendmsg(iov, gso if batch > 1 else [], 0, GROUP)
                        sends += 1
                        iov = []
                if iov:
                    sock.sendmsg(iov, gso if len(iov) > 2 else [], 0, GROUP)
                    sends += 1
                sums[done] = 0.0  # (sent: the kernel has copied them)
        _say(contributions=taken, receives=receives, sends=sends)


def worker(bind: str, appliance_address: str, segments: int, payload: int, iters: int,
           warmup: int, window: int, workers: int, silence_s: float = SILENCE_S) -> None:
    datagram = HEADER_SIZE + payload
    records, batch, gso = _records(payload), _batch_of(datagram), _segmenting(datagram)
    data = np.ones((segments, payload // 4), np.float32)
    out = np.zeros_like(data)
    headers, contributions = _headers(segments), _bytes_of(data)
    buf = bytearray(_BUFFER)
    batch_view = np.frombuffer(buf, records, _BUFFER // datagram)
    numbers, payloads = batch_view["segment"], batch_view["payload"]
    dest = (appliance_address, PORT)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        enlarge_buffers(tx, _SOCKET_BUFFER)
        tx.bind((bind, 0))
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _receiver(rx)
        rx.bind(GROUP)
        rx.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                      socket.inet_aton(GROUP[0]) + socket.inet_aton(bind))
        _say(ready=True)
        _wait_for_go()
        times = []
        receives = sends = 0
        cpu_from = resource.getrusage(resource.RUSAGE_SELF)
        for iteration in range(warmup + iters):
            if iteration == warmup:
                _say(warm=True)
                _wait_for_go()
                cpu_from = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            sent = got = 0
            while got < segments:
                while sent < segments and sent - got < window:
                    end = min(segments, sent + batch, got + window)
                    iov: list[memoryview] = []
                    for k in range(sent, end):
                        iov += (headers[k * HEADER_SIZE:(k + 1) * HEADER_SIZE],
                                contributions[k * payload:(k + 1) * payload])
                    tx.sendmsg(iov, gso if end - sent > 1 else [], 0, dest)
                    sends += iteration >= warmup
                    sent = end
                if not select.select([rx], [], [], silence_s)[0]:
                    _lost(f"worker {bind}: {segments - got} results never came")
                while nbytes := _take(rx, buf):
                    k = nbytes // datagram
                    receives += iteration >= warmup
                    index = numbers[:k]
                    at = _run_of(index)
                    out[index.astype(np.intp) if at is None else at] = payloads[:k]
                    got += k
            if iteration >= warmup:
                times.append(time.perf_counter() - start)
        cpu_to = resource.getrusage(resource.RUSAGE_SELF)
        kernel_s = cpu_to.ru_stime - cpu_from.ru_stime
        # Every worker's input is ones: every result is the number of workers, in every element.
        _say(times=times, ok=bool(np.all(out == workers)), receives=receives, sends=sends,
             cpu_s=cpu_to.ru_utime - cpu_from.ru_utime + kernel_s, kernel_cpu_s=kernel_s)


def _lost(what: str) -> NoReturn:
    """A datagram was lost: say what never came, and exit with `LOST_EXIT`."""
    print(f"{what} (lost: the floor has no recovery)", file=sys.stderr, flush=True)
    raise SystemExit(LOST_EXIT)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reduction_appliance.bench.floor_peer",
                                description=__doc__.split("\n\n", 1)[0])
    p.add_argument("role", choices=["appliance", "worker"])
    p.add_argument("--bind", required=True, help="this host's address")
    p.add_argument("--appliance", default="", help="the appliance's address (worker)")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--segments", type=int, required=True)
    p.add_argument("--payload", type=int, required=True, help="bytes per segment (of 4)")
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--window", type=int, default=64, help="segments in flight per worker")
    p.add_argument("--silence-s", type=float, default=SILENCE_S,
                   help="no progress this long: stop with an error (a datagram was lost)")
    args = p.parse_args(argv)
    if args.payload % 4 or args.payload <= 0 or HEADER_SIZE + args.payload > 65507:
        p.error("--payload: whole fp32 elements, one UDP datagram with the header")
    if min(args.workers, args.segments, args.iters, args.window) < 1 or args.warmup < 0:
        p.error("--workers, --segments, --iters and --window are at least 1, --warmup 0")
    if args.silence_s <= 0:
        p.error("--silence-s: more than 0 seconds")
    if args.role == "appliance":
        appliance(args.bind, args.workers, args.segments, args.payload,
                  args.warmup + args.iters, args.silence_s)
    elif not args.appliance:
        p.error("a worker needs --appliance")
    else:
        worker(args.bind, args.appliance, args.segments, args.payload, args.iters, args.warmup,
               args.window, args.workers, args.silence_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
