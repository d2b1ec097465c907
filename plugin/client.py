"""The numpy worker client: `allreduce(array, op="sum")` in place, through one or more appliances.

A thin driver of the sans-I/O `RoundPipeline` over a `WorkerTransport` (UDP by default, see
plugin/transport.py): contributions leave straight from the caller's array (gather, no copy);
each result's payload is copied from the transport's buffer into the array once its header is
checked. Results come on the job's multicast group and, for retransmissions or unicast jobs, on
the worker's own socket.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import numpy as np
from numpy.typing import NDArray

from reduction_appliance.dataplane.errors import PeerError, ReductionError
from reduction_appliance.dataplane.transport import Address
from reduction_appliance.dataplane.wire import (
    Header,
    Kind,
    Op,
    beat_interval,
    peek_kind,
    unpack_silent,
)

from . import rendezvous
from .arguments import check_array, check_in_place, dtype_of, op_of, staged
from .congestion import Congestion
from .joining import join_jobs
from .lease import Lease, heartbeat
from .multicast_watch import MulticastWatch, ask_unicast
from .pathprobe import STALL_S, PathWatch, abort_jobs, narrow_error, targets_of
from .pipeline import Outcome, RoundPipeline
from .rendezvous import JobInfo
from .rtt import RttEstimator, Timing
from .session import Endpoint, Packed, Repairs
from .silence import Diagnosis
from .transport import Outgoing, UdpWorkerTransport, WorkerTransport, decode_each

__all__ = ["ApplianceClient", "dtype_of", "op_of"]  # (the last two from plugin.arguments)

_log = logging.getLogger(__name__)
# How long a client whose block ended in an exception spends on each leave: the process is on
# its way out (a Ctrl-C), and a refused connection ends it at once anyway.
_LEAVE_ON_ERROR_S = 2.0


_new_tuple = tuple.__new__


# A transmission's endpoint, picked in C (the key runs per segment). Sorted by it alone, and stably:
# each core's first transmissions must leave in the order `due` numbered them (SendOrder), or
# the core would take the numbers' disorder for losses.
_by_endpoint: Callable[[Packed], int] = operator.itemgetter(0)


def _closed_error(call: str) -> ReductionError:
    return ReductionError(f"ApplianceClient.{call}() on a closed client: open another "
                          "(ApplianceClient(jobs, rank, ...)) to reduce again")


class ApplianceClient:
    """One rank of one job, on one or more appliances (segments are spread over all of them).

    `local_address` is this worker's address on the data network: contributions leave from it
    and the multicast group is joined on it. `lanes` > 1 splits the job's slots so that up to
    that many rounds (`start`) are on the wire at once (see plugin/pipeline.py); every rank of
    the job must use the same number. One thread drives a client (`allreduce`, `wait`,
    `progress`); it is not thread-safe: a second thread calling `start` or `wait` while one is
    inside is refused, saying so; `close` from another thread ends the call inside with a
    `ReductionError` saying the client was closed.

    The client joins every registered job as `rank` from the endpoint its transport sends from
    (`rejoin=True` for a restarted worker: see plugin/rendezvous.py); a job given already joined
    (with its cookie) is used as it is. Over UDP it then probes each appliance's path with
    datagrams of the job's size both ways (plugin/pathprobe.py; `probe_path=False` skips it,
    for a transport with no appliance behind it) and raises `PathTooNarrow` where they are
    lost while small ones pass, at join and when its rounds stall (aborting the job: its peers
    are told why). Without `timing`, the appliance's advised deadline applies. `congestion` is
    the policy of each core's congestion window (plugin/congestion.py; over datagrams only:
    RoCE's reliable connections lose nothing to queues); without it, the appliances' advised
    target (the least of them) applies, and none where one advises 0. A
    thread of its own (`lease`) sends a HEARTBEAT to every appliance ten times per liveness
    timeout, whatever the caller does between allreduces, so a slow rank is never declared
    dead; the answers name dead ranks (see plugin/pipeline.py). `transport`, `clock`
    and `join` replace the UDP sockets, the monotonic clock and the API call (tests pass an
    in-memory network and its simulated clock, and `lease=False`: they call `heartbeat()`).
    A `with` block that ends in an exception of the script's own (not the job's failure)
    leaves the jobs the client joined on its way out, so its peers fail at once with RankLeft.
    """

    def __init__(
        self,
        jobs: list[JobInfo],
        rank: int,
        *,
        local_address: str = "0.0.0.0",
        timing: Timing | None = None,
        congestion: Congestion | None = None,
        lanes: int = 1,
        transport: WorkerTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        join: Callable[..., JobInfo] = rendezvous.join,
        rejoin: bool = False,
        lease: bool = True,
        probe_path: bool = True,
    ) -> None:
        joined = join_jobs(jobs, rank, local_address=local_address, transport=transport,
                           join=join, rejoin=rejoin, lanes=lanes, probe_path=probe_path)
        self.world_size = joined.world_size
        self.rank = rank
        self.transport: WorkerTransport = joined.transport
        #: the window per core this host's receive buffer holds, where fewer than the slots
        self.window_cap = joined.window_cap
        self.jobs = joined.jobs
        # what it joined (and leaves if its block ends in an exception)
        self._joined_here = joined.joined_here
        self.endpoints: tuple[Endpoint, ...] = joined.endpoints
        self.segment_bytes = joined.segment_bytes
        #: routes to cores that fragment this job's datagrams (hostchecks.py)
        self.fragmenting = joined.fragmenting
        timing = timing or Timing(deadline=min(j.deadline_s for j in self.jobs))
        if self.transport.reliable:
            timing = timing.reliable()
        self.rtt = RttEstimator(timing)
        liveness = min(j.liveness_s for j in self.jobs)
        self.pipeline = RoundPipeline(self.endpoints, rank, self.world_size, self.segment_bytes,
                                      self.rtt, lanes, epoch=joined.epoch,
                                      liveness_timeout=liveness,
                                      congestion=None if self.transport.reliable
                                      else congestion or self._advised_congestion(),
                                      window_cap=self.window_cap)
        self._appliance_of = {e.address: e.appliance for e in self.endpoints}
        self._beat_to = [(j.cores[0].host, j.cores[0].port) for j in self.jobs]
        self.repairs = Repairs()  # the retransmissions of its rounds, by what sent each one
        # round -> its caller's array as bytes. A memoryview: slice assignment from the
        # transport's buffer is a plain memcpy (a numpy slice assigned from a memoryview took
        # 7 us per 64 KB, this 1 us).
        self._views: dict[int, memoryview] = {}
        self._unclaimed: list[Outcome] = []
        self._clock = clock
        self._addresses = [e.address for e in self.endpoints]
        self._closed = False
        self._close_asked_by = ""  # a thread that called close() while another drove
        self._diagnosis = Diagnosis(clock=clock)  # why an appliance went silent (its API)
        # each appliance's API, resolved while the network is up (plugin.silence asks it then)
        self._apis = [rendezvous.api_endpoint(j.appliance) for j in self.jobs]
        self._joined_at = clock()
        # Held by the thread inside `start` or `wait`: a second thread calling either at the
        # same time is refused, saying so (two threads' rounds once hung each other).
        self._driving = threading.RLock()
        self._driver = ""
        self._lease: Lease | None = None
        self._beat_s = beat_interval(liveness)
        self._last_turn = clock()  # when `progress` last read the sockets
        groups = [j.multicast for j in self.jobs if j.multicast is not None]
        self._multicast_watch = (
            (MulticastWatch(rank, groups, local_address), self.transport)
            if groups and isinstance(self.transport, UdpWorkerTransport) else None)
        #: probes the paths again when the rounds stall: a link may narrow under the job
        self._path_watch = (PathWatch(lambda: targets_of(self.jobs, rank), self.segment_bytes)
                            if probe_path and isinstance(self.transport, UdpWorkerTransport)
                            else None)
        self._watch_at = math.inf  # when to look at it next
        if lease:
            self._lease = Lease(self.heartbeat, self._beat_s, f"reduction-lease-{rank}")

    @property
    def retransmissions(self) -> int:
        """Segments its rounds sent again (`repairs` says what sent them)."""
        return self.repairs.total

    def heartbeat(self) -> None:
        """Tell every appliance this rank is alive (thread-safe: the lease thread calls it)."""
        seq = self.pipeline.heartbeat_seq + 1
        self.pipeline.heartbeat_seq = seq
        self.pipeline.beat(self._clock())
        for job, dest in zip(self.jobs, self._beat_to, strict=True):
            self.transport.send_raw(heartbeat(job, self.rank, seq, self.pipeline.epoch), dest)

    def resync(self) -> None:
        """Move the job to a new epoch at every appliance (after `JobDiverged`: every rank
        asks, the job moves once; after an outage that cut a round short on every rank) and
        continue there."""
        seen = self.pipeline.epoch
        self.jobs = [rendezvous.resync(j, seen) for j in self.jobs]
        self.pipeline.adopt_epoch(max(j.epoch for j in self.jobs))

    def abandon(self, reason: str) -> list[Outcome]:
        """End every queued and in-flight round at once with `ReductionError(reason)`; their
        arrays are no longer written. Returns their outcomes."""
        outcomes = self.pipeline.fail_all(ReductionError(reason))
        self._views.clear()
        return outcomes

    def close(self) -> None:
        """Close the transport; rounds still queued or in flight end with a `ReductionError`.
        Called while another thread is inside `allreduce` or `wait`, it returns at once and
        that thread closes the client at its next turn (within a heartbeat interval: the
        answers wake it), its call raising the error."""
        if not self._driving.acquire(blocking=False):
            self._close_asked_by = threading.current_thread().name
            if not self._driving.acquire(blocking=False):
                return  # the driving thread closes it: at its next turn, or on its way out
        try:
            if not self._closed:
                if self._lease is not None:
                    self._lease.stop()
                self._closed = True
                self._unclaimed.extend(self.abandon(
                    "the appliance client was closed during the allreduce (by thread "
                    f"{self._close_asked_by or threading.current_thread().name!r})"))
                self.transport.close()
        finally:
            self._driving.release()

    def __enter__(self) -> ApplianceClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        if t is not None and not issubclass(t, ReductionError):
            self._leave_on_the_way_out(t.__name__)
        self.close()

    def _leave_on_the_way_out(self, why: str) -> None:
        """The script this client serves ends in an exception of its own (a failed data
        loader, Ctrl-C): leave the jobs it joined, so that its peers fail at once with
        RankLeft instead of waiting out the liveness timeout for RankSilent. Not where the job
        itself failed (a round raised): its peers meet that failure too and are told why, and
        the appliance's status keeps what explains it. Best effort and brief; a job already
        gone, or an appliance not answering, is left as it is."""
        if self.pipeline.failed_by is not None:
            return
        rendezvous.leave_quietly(self._joined_here, self.rank, _LEAVE_ON_ERROR_S)
        if self._joined_here:
            _log.info("rank %d left job %s on its way out (%s)", self.rank,
                      self._joined_here[0].name, why)
        self._joined_here = []

    # ---- the collective ----
    def allreduce(self, array: NDArray[Any], op: str | Op = "sum") -> NDArray[Any]:
        """Reduce `array` over all ranks in place and return it. Raises `AllreduceTimeout`
        (naming the silent appliance cores and missing ranks) instead of hanging. An array
        that is not one contiguous block is reduced in a contiguous copy, then copied back."""
        check_in_place(array)
        if not array.flags.c_contiguous:
            return staged(array, lambda copy: self.allreduce(copy, op))
        self.wait(self.start(array, op))
        return array

    def start(self, array: NDArray[Any], op: str | Op = "sum") -> int:
        """Queue an in-place allreduce of `array` (contiguous, writable, left untouched by the
        caller until it finishes) and return its round number; `progress` or `wait` run it.
        With several lanes, up to `lanes` rounds are on the wire at once."""
        with self._driven("start"):
            return self._start(array, op)

    @contextlib.contextmanager
    def _driven(self, call: str) -> Iterator[None]:
        if not self._driving.acquire(blocking=False):
            raise ReductionError(
                f"ApplianceClient.{call}() called from thread "
                f"{threading.current_thread().name!r} while thread {self._driver!r} drives "
                "this client: one thread drives a client (give each thread a client of its "
                "own, or hold a lock around its calls)")
        outer = not self._driver
        if outer:
            self._driver = threading.current_thread().name
        try:
            if self._close_asked_by:
                self.close()
            yield
        finally:
            if outer:
                self._driver = ""
            self._driving.release()
            if outer and self._close_asked_by and not self._closed:  # asked as it left
                self.close()

    def _start(self, array: NDArray[Any], op: str | Op) -> int:
        if self._closed:
            raise _closed_error("start")
        check_array(array)
        dtype = dtype_of(array)
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ReductionError("start() needs a contiguous, writable array "
                                 "(allreduce() stages any other)")
        pipeline = self.pipeline
        if pipeline.idle and (pipeline.holds_verdicts()
                                or self._clock() - self._last_turn > self._beat_s):
            # An idle worker reads nothing: what came meanwhile (its heartbeats' answers, a
            # new epoch, an appliance back) waits in the socket, oldest first. Read it before
            # the round starts, or a verdict the newer answers lift (a rank silent, then
            # replaced) would fail the round. (Back-to-back calls skip this syscall.)
            self.transport.receive(self._on_datagram, self._on_run)
        round_no = pipeline.submit(dtype, op_of(op), array.nbytes)
        if self._path_watch is not None and self._watch_at == math.inf:
            self._watch_at = self._clock() + STALL_S  # (not sooner: see `_watch_path`)
        self._views[round_no] = array.reshape(-1).view(np.uint8).data
        return round_no

    def wait(self, round_no: int) -> None:
        """Drive the rounds until `round_no` is done; raise its error if it failed. Outcomes
        of other rounds that end meanwhile are kept for the next `progress`."""
        with self._driven("wait"):
            self._wait(round_no)

    def _wait(self, round_no: int) -> None:
        while True:
            for outcome in self._unclaimed:
                if outcome.ticket == round_no:
                    self._unclaimed.remove(outcome)
                    if outcome.error is not None:
                        raise outcome.error
                    return
            if self._close_asked_by and not self._closed:  # by another thread (close())
                self.close()
                continue
            if self._closed:  # (its sockets are: a bare EBADF otherwise)
                raise _closed_error("wait")
            if round_no not in self._views:
                raise ReductionError(f"round {round_no} was never started on this client")
            ended = self.progress()  # (it takes the unclaimed list over: extend after)
            self._unclaimed.extend(ended)

    def _advised_congestion(self) -> Congestion:
        """The window policy the appliances advise: the least of their targets; fixed windows
        when one advises none (0)."""
        target = min(j.queue_target_s for j in self.jobs)
        return Congestion(target=target) if target > 0 else Congestion(enabled=False)

    def progress(self, timeout: float | None = None,
                 wake: socket.socket | None = None) -> list[Outcome]:
        """One turn of the transport: send what is due, wait for datagrams (at most until the
        next retransmission, `timeout`, or until `wake` is readable; forever when idle with
        neither), take them in. Returns the rounds that ended."""
        pipeline = self.pipeline
        # The last turn's closing `_send_due` sent everything its results released; what may
        # have come due since is time's doing (a timer, a deadline, a silence) or a new round,
        # and `wakeup` says when either is. Asking `due` anyway costs a few microseconds per
        # turn, and a fast link's worker turns about once per ten segments.
        wake_at = pipeline.wakeup()
        if wake_at <= self._clock():
            self._send_due()
            wake_at = pipeline.wakeup()
        if self._watch_at <= self._clock():
            self._watch_path(self._clock())
        wait = min(wake_at, self._watch_at) - self._clock()
        if timeout is not None:
            wait = min(wait, timeout)
        self.transport.wait(None if wait == math.inf else max(0.0, wait), wake)
        self.transport.receive(self._on_datagram, self._on_run)
        self._send_due()  # results just stored released their slots' next segments
        if pipeline.overdue:  # (empty but for an appliance silent for over a second)
            self._ask_overdue()
        self._last_turn = self._clock()
        ended = pipeline.finished()
        if ended and any(type(o.error) in Diagnosis.EXPLAINS for o in ended):
            ended = self._diagnosis.explained(ended, self.jobs, self.rank)  # (asks their APIs)
        outcomes = [*self._unclaimed, *ended]
        self._unclaimed = []
        for outcome in outcomes:
            view = self._views.pop(outcome.ticket, None)
            if view is not None:
                self.repairs = self.repairs.plus(outcome.repairs)
                if self._multicast_watch is not None and outcome.error is None:
                    self._watch_multicast(outcome, -(-len(view) // self.segment_bytes))
        return outcomes

    def _ask_overdue(self) -> None:
        """Ask whether the daemons of the appliances found overdue still run (a TCP connection
        to each API: plugin.silence); where one does not, its jobs went with it: every round
        fails, for good."""
        for appliance, quiet in self.pipeline.take_overdue():
            ended = self._diagnosis.ended(self.jobs[appliance], self._apis[appliance], quiet,
                                          self.rank)
            if ended is not None:
                self._unclaimed.extend(self.pipeline.fail_all(ended, for_good=True))
                return

    def _watch_multicast(self, outcome: Outcome, segments: int) -> None:
        """After a round of `segments`: where the job's multicast results do not reach this
        host, say so and ask each appliance for them by unicast (once)."""
        assert self._multicast_watch is not None
        watch, udp = self._multicast_watch
        unheard = watch.round_ended(udp.heard_on_groups, outcome.repairs.total, segments)
        if not unheard:
            return
        self.jobs, asked = ask_unicast(self.jobs, self.rank)
        _log.warning("%s. Asked the appliance: %s", unheard, "; ".join(asked))
        self._multicast_watch = None

    def _watch_path(self, now: float) -> None:
        """Probe the paths when the rounds stall (pathprobe.PathWatch), looked at when its next
        probe could be due (every turn cost 2 us); where one narrowed under the job, abort it
        (its peers hear why at once) and fail its rounds for good."""
        watch = self._path_watch
        assert watch is not None
        quiet_since = self.pipeline.quiet_since()
        if quiet_since is not None:  # (and say once if ranks it waits for never joined)
            self._diagnosis.warn_missing(self.jobs, self.rank, now - quiet_since)
        verdicts = watch.look(now, quiet_since, self.transport.send_raw)
        self._watch_at = watch.next_at(quiet_since)  # (inf with nothing in flight)
        if verdicts is not None:
            self._path_watch, self._watch_at = None, math.inf
            abort_jobs(self.jobs, self.rank, verdicts, self.segment_bytes)
            stalled = 0.0 if quiet_since is None else now - quiet_since
            self._unclaimed.extend(self.pipeline.fail_all(narrow_error(
                self.rank, verdicts, self.segment_bytes, stalled_s=stalled), for_good=True))

    def _send_due(self) -> None:
        views = self._views
        addresses = self._addresses
        if self.pipeline.timer_expired(self._clock()):
            # Take in what already came before retransmitting: a timer that ran out while this
            # process was not running (two cores shared by many processes: often) usually has
            # its answer waiting in the socket. Asking again would only cost a query and the
            # appliance's resending that whole result.
            self.transport.receive(self._on_datagram, self._on_run)
        # Grouped by endpoint so consecutive segments to one core leave in one GSO send.
        due = sorted(self.pipeline.due_packed(self._clock()), key=_by_endpoint)
        if due:
            # A contribution's payload is its segment of the tensor (the view's end clamps
            # the last one). (Outgoing's fields in order through tuple.__new__, as wire.unpack
            # does: per segment sent.)
            size = self.segment_bytes
            self.transport.send([
                _new_tuple(Outgoing, (addresses[e], header, views[ticket][k * size:k * size + size]
                                      if note is None else memoryview(note)))
                for e, k, header, ticket, note in due])

    def _on_run(self, buf: bytearray, view: memoryview, nbytes: int, size: int,
                source: Address, waited: float) -> None:
        """A coalesced receive (or one datagram) that waited `waited` seconds in this host: the
        results of a round straight into its array, a run at a time
        (`RoundPipeline.take_results`); anything else through `_on_datagram`."""
        pipeline = self.pipeline
        now = self._clock()
        appliance = self._appliance_of.get(source)
        at = 0
        while at < nbytes:
            if peek_kind(buf, at) == Kind.RESULT:
                if appliance is not None:  # (anything else is heard in `_on_datagram`)
                    pipeline.heard(appliance, now)
                at = pipeline.take_results(buf, view, at, nbytes, size, source, now,
                                           self._views, now - waited)
            if at < nbytes:  # not a result it wanted: decode and handle it alone
                end = min(at + size, nbytes)
                decode_each(buf, view, at, end, size, source, self._on_datagram)
                at = end

    def _on_datagram(self, h: Header, payload: memoryview, source: Address) -> None:
        pipeline = self.pipeline
        now = self._clock()
        appliance = self._appliance_of.get(source)
        if appliance is not None and h.kind is not Kind.UNKNOWN_JOB:  # (not a sign of the job)
            pipeline.heard(appliance, now)
        if h.kind is Kind.RESULT:
            wanted = pipeline.accept(h, source)
            if wanted is not None:
                rnd, k = wanted
                self._views[rnd.ticket][h.offset:h.offset + h.length] = payload
                pipeline.stored(rnd, k, now, h.rank, h.flags)
        elif h.kind is Kind.PENDING:
            pipeline.on_pending(h, bytes(payload), now, source)
        elif h.kind is Kind.MISSING:
            pipeline.on_missing(h, bytes(payload), source)
        elif h.kind is Kind.ABORTED:
            pipeline.on_aborted(h, source, bytes(payload).decode(errors="replace"))
        elif h.kind is Kind.RESYNC:
            pipeline.on_resync(h, source)
        elif h.kind is Kind.DIVERGED:
            pipeline.on_diverged(h, bytes(payload).decode(errors="replace"), source)
        elif h.kind is Kind.PATH_ECHO and self._path_watch is not None:
            self._path_watch.answered(h, source)
        elif h.kind is Kind.UNKNOWN_JOB and appliance is not None:
            gone = self._diagnosis.job_gone(self.jobs[appliance], h, self.rank, self._joined_at)
            if gone is not None:  # (the API asked: the appliance restarted without the job)
                self._unclaimed.extend(pipeline.fail_all(gone, for_good=True))
        elif h.kind is Kind.LIVENESS:
            try:
                silent = unpack_silent(payload)
            except PeerError:
                return
            pipeline.on_liveness(h, silent, source)
