"""What comes back to a round (plugin/session.py): which RESULTs it still wants, and what taking
one does to its state. Two ways in, kept equal by tests/unit/test_worker_runs.py:

* `accept` then `stored`, one decoded `Header` at a time: notices' neighbours, a transport
  without coalesced receives, the simulated networks of the tests.
* `take_results`, the worker's burst path: with UDP GRO a receive holds up to 64 KB of
  consecutive datagrams from one core, on a clean network nearly all of them results of one
  round, each wanted once. Each costs one struct unpacking, the checks and one copy from the
  receive buffer into the round's array (where the caller's tensor lives), with the round's
  state looked up once per run instead of once per result: a NamedTuple and three method calls
  per result were most of a fast link's per-segment Python (bench.hotpath). It stops at the
  first datagram that is anything else (a duplicate, a notice, another round's, a malformed
  one), for the caller to decode the usual way.

Sans-I/O: bytes in, the round's state and the array updated.
"""

from __future__ import annotations

from collections import deque

from reduction_appliance.dataplane.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    SERIAL_AT,
    SERIALS,
    VERSION,
    DType,
    Flags,
    Header,
    Kind,
)

from .congestion import CongestionWindow
from .expiry import CoreSigns
from .rtt import RttEstimator
from .serials import ResultSerials
from .slotplan import Address, Endpoint

__all__ = ["RoundAnswers"]

QUEUED = int(Flags.QUEUED)
REPAIRED = int(Flags.REPAIRED)
RESENT = int(Flags.RETRANSMIT)  # on a RESULT: resent to this rank alone (wire.py)


class RoundAnswers:
    """The answer side of `AllreduceRound`, which sets these in its constructor."""

    endpoints: tuple[Endpoint, ...]
    rank: int
    round: int
    epoch: int
    dtype: DType
    nbytes: int
    segment_bytes: int
    segments: int
    remaining: int
    # The round's last result came resent to this rank alone (its multicast copy was lost):
    # the rank ends the round after its peers, late into the next by that repair
    # (AllreduceRound's `late`).
    ended_late: bool
    _result_at: float  # when the latest result was taken (the round's deadline counts from it)
    _rtt: RttEstimator
    _signs: CoreSigns
    _serials: ResultSerials
    _window: CongestionWindow | None
    _done: bytearray
    _use: list[int]
    _sent_at: list[float]
    _payload_sent: list[float]
    _retransmitted: bytearray
    _timed_out: bytearray
    _in_flight: list[int]
    _mine: list[int]
    _seq: list[int]
    _acked_seq: list[int]
    _unanswered: list[dict[int, None]]
    _lowest: list[int]
    _ready: deque[int]

    def accept(self, h: Header, source: Address | None = None) -> int | None:
        """The segment whose payload the RESULT `h` carries, if we still want it, else None.
        Given its `source`, only the core the segment went to may have sent it."""
        # One unpacking instead of a field lookup per check.
        kind, dtype, _, _, job_id, _, cookie, rnd, _, offset, length, use, epoch, serial = h
        if kind is not Kind.RESULT or rnd != self.round or dtype != self.dtype \
                or epoch != self.epoch:
            return None
        k, rest = divmod(offset, self.segment_bytes)
        if (rest or k >= self.segments or self._done[k] or use != self._use[k]
                or length != min(self.segment_bytes, self.nbytes - offset)):
            return None
        e = k % len(self.endpoints)
        ep = self.endpoints[e]
        if (job_id != ep.job_id or cookie != ep.cookie
                or (source is not None and source != ep.address)):
            return None
        self._heard_serial(e, serial)
        return k

    def _heard_serial(self, e: int, serial: int) -> None:
        serials = self._serials
        if serial == (serials.newest[e] + 1) % SERIALS:  # the next, nearly always
            serials.newest[e] = serial
        else:
            serials.jump(e, serial)

    def stored(self, k: int, now: float, completer: int = -1, flags: int = 0) -> None:
        """The result of segment k is in place: release the slot's next segment. `completer`:
        the rank whose contribution completed it (the RESULT's rank; -1: not known); `flags`:
        the RESULT's (QUEUED: that rank found a queue; REPAIRED: a repair held it up, no
        round-trip sample; RETRANSMIT: resent to this rank alone, see `ended_late`)."""
        done = self._done
        if done[k]:
            return
        done[k] = 1
        self.remaining -= 1
        if not self.remaining:  # its last: resent to this rank alone?
            self.ended_late = bool(flags & RESENT)
        self._result_at = now
        n_ep = len(self.endpoints)
        e = k % n_ep
        self._signs.heard_at[e] = now
        in_flight = self._in_flight
        window = self._window
        if not self._retransmitted[k]:
            self._signs.progress_at[e] = now
            if not self._timed_out[k] and not flags & REPAIRED:
                self._rtt.sample(e, now - self._sent_at[k], in_flight[e])
            if window is not None and window.shrunk:
                window.on_answer(e)
        if window is not None and completer >= 0:
            if completer == self.rank:  # ours came last: our payload's round trip is the path's
                window.on_delay(e, now - self._payload_sent[k], now)
            elif flags & QUEUED or window.queued[e]:  # a peer's finding, echoed (congestion.py)
                window.on_mark(e, bool(flags & QUEUED), now, self._rtt.srtt(e) or self._rtt.rto(e))
        in_flight[e] -= 1
        self._mine[e] -= 1
        seq = self._seq[k]
        if seq > self._acked_seq[e]:
            self._acked_seq[e] = seq
        self._unanswered[e].pop(k, None)
        lowest = self._lowest
        if k == lowest[e]:
            low = k
            while low < self.segments and done[low]:
                low += n_ep
            lowest[e] = low
        nxt = k + self.endpoints[e].slots * n_ep
        if nxt < self.segments:
            self._ready.append(nxt)

    def take_results(self, buf: bytearray, view: memoryview, start: int, nbytes: int,
                     size: int, source: Address, now: float, out: memoryview,
                     arrived: float | None = None) -> int:
        """Store the results that a coalesced receive holds from `start` on (datagrams `size`
        bytes apart, from `source`) straight into `out`, the round's array: `accept` and
        `stored` for each, in line. `arrived`: when they reached this host, if the kernel
        said (else `now`): a delay sample ends there, since what came after was this host's
        own wait, no queue on the path. Returns where the first datagram not taken begins;
        `nbytes` when it took them all."""
        unpack_from = HEADER.unpack_from
        round_no, dtype_no, epoch_no, rank = self.round, int(self.dtype), self.epoch, self.rank
        seg, segments, total = self.segment_bytes, self.segments, self.nbytes
        done, use_of, endpoints = self._done, self._use, self.endpoints
        n_ep = len(endpoints)
        retransmitted, timed_out, sent_at = self._retransmitted, self._timed_out, self._sent_at
        sample, rtt = self._rtt.sample, self._rtt
        window = self._window
        shrinking = window is not None and window.shrunk
        seq_of, ready = self._seq, self._ready
        result = int(Kind.RESULT)
        if arrived is None or arrived > now:
            arrived = now
        # Every datagram of a run comes from `source`, and every segment to one core is
        # answered by that core alone: a run answers one core. Its state is read here once and
        # written back on the way out, not looked up per result.
        e = -1
        ep: Endpoint | None = None
        in_flight = acked = low = nxt_step = 0
        newest = -1
        progressed = False
        unanswered: dict[int, None] = {}
        taken = last_flags = 0
        try:
            for at in range(start, nbytes, size):
                end = at + size if at + size < nbytes else nbytes
                if end - at < HEADER_SIZE:
                    return at
                (magic, version, kind, dtype, _, flags, job_id, completer, epoch, cookie, rnd, _,
                 offset, length, use) = unpack_from(buf, at)
                if (magic != MAGIC or version != VERSION or kind != result or rnd != round_no
                        or dtype != dtype_no or epoch != epoch_no
                        or end - at != HEADER_SIZE + length):
                    return at
                k, rest = divmod(offset, seg)
                if (rest or k >= segments or done[k] or use != use_of[k]
                        or length != (seg if offset + seg <= total else total - offset)):
                    return at
                if ep is None:  # the run's first result names its core
                    e = k % n_ep
                    ep = endpoints[e]
                    if source != ep.address:
                        return at
                    in_flight, acked, low = self._in_flight[e], self._acked_seq[e], self._lowest[e]
                    newest, unanswered = self._serials.newest[e], self._unanswered[e]
                    nxt_step = ep.slots * n_ep
                elif k % n_ep != e:
                    return at
                if job_id != ep.job_id or cookie != ep.cookie:
                    return at
                serial = buf[at + SERIAL_AT]
                if serial == (newest + 1) % SERIALS:
                    newest = serial
                else:
                    self._serials.newest[e] = newest
                    self._serials.jump(e, serial)
                    newest = self._serials.newest[e]
                out[offset:offset + length] = view[at + HEADER_SIZE:end]
                # `stored`, with the lookups above
                done[k] = 1
                taken += 1
                last_flags = flags
                if not retransmitted[k]:
                    progressed = True
                    if not timed_out[k] and not flags & REPAIRED:
                        sample(e, now - sent_at[k], in_flight)
                    if shrinking and window is not None:  # (whole again: a no-op)
                        window.on_answer(e)
                if window is not None:
                    if completer == rank:
                        window.on_delay(e, arrived - self._payload_sent[k], now)
                        shrinking = window.shrunk
                    elif flags & QUEUED or window.queued[e]:
                        window.on_mark(e, bool(flags & QUEUED), now,
                                       rtt.srtt(e) or rtt.rto(e))
                        shrinking = window.shrunk
                in_flight -= 1
                seq = seq_of[k]
                if seq > acked:
                    acked = seq
                unanswered.pop(k, None)
                if k == low:
                    while low < segments and done[low]:
                        low += n_ep
                nxt = k + nxt_step
                if nxt < segments:
                    ready.append(nxt)
            return nbytes
        finally:
            if taken:
                self.remaining -= taken
                if not self.remaining:
                    self.ended_late = bool(last_flags & RESENT)
                self._result_at = now
                self._signs.heard_at[e] = now
                if progressed:
                    self._signs.progress_at[e] = now
                self._mine[e] -= taken
                self._in_flight[e] = in_flight
                self._acked_seq[e] = acked
                self._lowest[e] = low
                self._serials.newest[e] = newest
