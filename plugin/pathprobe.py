"""Does the path to each appliance carry the job's datagrams whole? Asked as a worker joins, and
again when its rounds stall.

A link between a worker and the appliance with a smaller MTU than both ends (jumbo frames on
the hosts, 1500 on one switch port) drops every full-size datagram without a word: a switch
forwards frames and sends no ICMP, so neither host learns of a smaller path MTU, while the
48-byte heartbeats and queries still pass. Such a job used to wait out its deadline (60 s) and
then blame the rank behind that port, whose contributions had all been sent.

So a worker that joins over UDP sends each appliance core PATH_PROBEs (dataplane/wire.py): a
header-only one, and one of each size on a ladder of common MTUs up to the job's own datagram,
padded on the way up; and as many small ones that ask for echoes padded to those sizes on the
way down. It repeats every `TRY_EVERY_S` what has not come back. Every size back both ways:
the path is fine, usually within one round trip. Sizes still missing after the header-only
probe came back `TRIES_FOR_VERDICT` times: the path is narrower than the job's datagrams, and
`PathTooNarrow` says which sizes passed each way and what to change. Nothing back from a core
within `SILENT_S` (a firewall, a NAT, an appliance that is gone), or no verdict within
`BUDGET_S`: nothing said here about that path; the client's own diagnosis
(plugin/silence.py) says more at the first allreduce.

A narrow rank aborts its jobs through the API, saying why (`abort_jobs`): its peers cannot
finish a round without its datagrams, and fail at once with `JobAborted` naming the cause.

`PathProbe` is the sans-I/O core (what to send when, what the echoes say); `probe_paths` drives
it over a worker transport, and `check_paths` (what `ApplianceClient` calls at join) probes
every core of the jobs joined and aborts them where a path is narrow. `PathWatch` (sans-I/O
too) probes again mid-job when the rounds take no result for `STALL_S`: a link can narrow under
a running job.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from reduction_appliance.dataplane.errors import PathTooNarrow, ReductionError
from reduction_appliance.dataplane.transport import Address
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    IP_UDP_HEADERS,
    DType,
    Header,
    Kind,
    Op,
    pack_into,
)

from . import rendezvous
from .rendezvous import JobInfo
from .transport import WorkerTransport

__all__ = ["BUDGET_S", "SILENT_S", "STALL_S", "TRIES_FOR_VERDICT", "TRY_EVERY_S", "PathProbe",
           "PathTarget", "PathWatch", "Verdict", "abort_jobs", "check_paths", "narrow_error",
           "probe_paths", "targets_of"]

# Where Ethernet paths usually stop: IPv6's minimum, plain Ethernet, 4K frames, jumbo frames.
COMMON_MTUS = (1280, 1500, 4096, 9000)
TRY_EVERY_S = 0.05
# Header-only echoes needed before a size never answered counts as lost on the path, not to
# chance: with 20% loss each way a size misses 16 tries in a row about once in 10 million.
TRIES_FOR_VERDICT = 16
BUDGET_S = 3.0
# A core that echoes nothing at all for this long is silent (a firewall, a NAT, gone): no
# verdict on its path, and no longer held up for it. Its job's liveness timeout (5 s, 2 s in
# tests) runs meanwhile without heartbeats, and the client's own diagnosis of the silence
# (plugin/silence.py) asks the appliance before it evicts the job.
SILENT_S = 0.5
ABORT_S = 2.0  # a rank whose path is narrow aborts its jobs within this (best effort)
# Rounds in flight without a result this long: probe the paths again (PathWatch).
STALL_S = 1.0
_OVERHEAD = HEADER_SIZE + IP_UDP_HEADERS  # a payload's datagram on the wire, less its payload


@dataclass(frozen=True)
class PathTarget:
    """One appliance core to probe, and this rank's place in its job."""

    dest: Address
    job_id: int
    rank: int
    cookie: int
    epoch: int


@dataclass
class Verdict:
    """What came back from one appliance core, as IP datagram sizes (what an MTU bounds)."""

    target: PathTarget
    up_ok: list[int] = field(default_factory=list)  # sizes that reached the appliance
    up_lost: list[int] = field(default_factory=list)  # sizes that did not
    down_ok: list[int] = field(default_factory=list)
    down_lost: list[int] = field(default_factory=list)

    @property
    def narrow(self) -> bool:
        return bool(self.up_lost or self.down_lost)


def ladder(payload_bytes: int) -> list[int]:
    """The payload sizes probed for a job of `payload_bytes` segments: those whose datagrams
    are the common MTUs below the job's, then the job's own."""
    return [mtu - _OVERHEAD for mtu in COMMON_MTUS if mtu - _OVERHEAD < payload_bytes] + [
        payload_bytes]


class PathProbe:
    """The probes of one join (sans-I/O): `due` what to send, `answered` each echo, `outcome`
    the verdicts once there are any."""

    def __init__(self, targets: Sequence[PathTarget], payload_bytes: int, now: float) -> None:
        self.targets = list(targets)
        self.sizes = ladder(payload_bytes)
        self._started = now
        self._next_try = now
        self._tries = 0
        # per target: sizes not yet back each way, and the tries whose header-only probe came
        # back (a set: a duplicated echo is one try)
        self._up = {t.dest: set(self.sizes) for t in self.targets}
        self._down = {t.dest: set(self.sizes) for t in self.targets}
        self._baseline: dict[Address, set[int]] = {t.dest: set() for t in self.targets}
        self._heard = {t.dest: False for t in self.targets}  # any echo at all

    def next_at(self) -> float:
        """When `due` next has something to send."""
        return self._next_try

    def due(self, now: float) -> list[tuple[Address, bytes]]:
        """The datagrams of the next try, if it is time: per target a header-only probe first,
        then the sizes still missing, smallest first (a receiver's GRO never merges a larger
        datagram after a smaller one, so each stays a datagram of its own)."""
        if now < self._next_try:
            return []
        self._tries += 1
        self._next_try = now + TRY_EVERY_S
        out = []
        for t in self.targets:
            out.append((t.dest, self._datagram(t, 0, 0)))
            out.extend((t.dest, self._datagram(t, 0, s)) for s in sorted(self._down[t.dest]))
            out.extend((t.dest, self._datagram(t, s, 0)) for s in sorted(self._up[t.dest]))
        return out

    def _datagram(self, t: PathTarget, up: int, down: int) -> bytes:
        buf = bytearray(HEADER_SIZE + up)
        pack_into(buf, Header(Kind.PATH_PROBE, DType.FLOAT32, Op.SUM, 0, t.job_id, t.rank,
                              t.cookie, self._tries, 0, down, up, 0, t.epoch))
        return bytes(buf)

    def answered(self, h: Header, source: Address) -> None:
        """An echo: `h.offset` is the size its probe arrived with, `h.length` its own padding.
        Anything else, or from elsewhere, is ignored."""
        if h.kind is not Kind.PATH_ECHO or source not in self._up:
            return
        t = next(t for t in self.targets if t.dest == source)
        if h.job_id != t.job_id or h.cookie != t.cookie:
            return
        self._heard[source] = True
        if h.offset == 0 and h.length == 0:
            self._baseline[source].add(h.round)
        self._up[source].discard(h.offset)
        self._down[source].discard(h.length)

    def outcome(self, now: float) -> list[Verdict] | None:
        """None while the probes go on; then the verdicts of the paths it could judge (every
        size back, or the missing ones missed enough tries), once every other core has been
        silent for `SILENT_S` or the budget has run out ([]: none could be judged)."""
        elapsed = now - self._started
        waiting = [d for d in self._up if not self._settled(d)
                   and (self._heard[d] or elapsed < SILENT_S)]
        if waiting and elapsed < BUDGET_S:
            return None
        return [self._verdict(t) for t in self.targets if self._settled(t.dest)]

    def _settled(self, dest: Address) -> bool:
        return ((not self._up[dest] and not self._down[dest])
                or len(self._baseline[dest]) >= TRIES_FOR_VERDICT)

    def _verdict(self, t: PathTarget) -> Verdict:
        up, down = self._up[t.dest], self._down[t.dest]
        return Verdict(t, [s + _OVERHEAD for s in self.sizes if s not in up],
                       [s + _OVERHEAD for s in self.sizes if s in up],
                       [s + _OVERHEAD for s in self.sizes if s not in down],
                       [s + _OVERHEAD for s in self.sizes if s in down])


def _listed(sizes: Sequence[int]) -> str:
    return " and ".join([", ".join(map(str, sizes[:-1])), str(sizes[-1])] if len(sizes) > 1
                        else [str(sizes[0])])


def _way(ok: Sequence[int], lost: Sequence[int]) -> str:
    arrive = f"{_listed(ok)} B arrive" if ok else "none of the sizes tried arrives"
    return f"{min(lost)} B and more are lost ({arrive})"


def narrow_error(rank: int, verdicts: Sequence[Verdict], payload_bytes: int,
                 stalled_s: float | None = None) -> PathTooNarrow:
    """What a user reads when paths drop the job's datagrams: which sizes passed each way (the
    cores whose paths agree, together), which paths carry them whole, and the two ways out.
    `stalled_s`: found mid-job, after so long without a result (PathWatch)."""
    datagram = payload_bytes + _OVERHEAD
    alike: dict[tuple[tuple[int, ...], ...], list[str]] = {}
    for v in verdicts:
        if v.narrow:
            sizes = (tuple(v.up_ok), tuple(v.up_lost), tuple(v.down_ok), tuple(v.down_lost))
            alike.setdefault(sizes, []).append(f"{v.target.dest[0]}:{v.target.dest[1]}")
    widest = _widest(verdicts, datagram)
    paths = []
    for (up_ok, up_lost, down_ok, down_lost), dests in alike.items():
        ways = []
        if up_lost:
            ways.append(f"to the appliance, {_way(up_ok, up_lost)}")
        if down_lost:
            ways.append("from it, the same" if (down_ok, down_lost) == (up_ok, up_lost)
                        else f"from it, {_way(down_ok, down_lost)}")
        one = len(dests) == 1
        paths.append(f"the path{'' if one else 's'} between this host and appliance "
                     f"{'' if one else 'cores '}{', '.join(dests)} {'loses' if one else 'lose'} "
                     f"this job's datagrams ({datagram} B, for {payload_bytes} B segments) "
                     f"while {_OVERHEAD} B ones pass both ways: " + "; ".join(ways))
    whole = [f"{v.target.dest[0]}:{v.target.dest[1]}" for v in verdicts if not v.narrow]
    some = (f" The paths to {', '.join(whole)} carry them whole: a link on some paths only "
            "(a member of an ECMP group or a LAG) has the smaller MTU." if whole else "")
    fit = (f"set the appliance's dataplane.mtu to {widest} (segments of {widest - _OVERHEAD} B)"
           if widest > _OVERHEAD else "find the link that drops them")
    when = ("" if stalled_s is None else f" Found mid-job, {stalled_s:.1f} s without a "
            "result: a link on the path changed since this rank joined.")
    return PathTooNarrow(
        f"rank {rank}: " + ". And ".join(paths) + "." + some + " A link between has a smaller "
        "MTU than both ends (a switch port left at 1500 on a jumbo-frame rack?): give every "
        f"link on the path an MTU of at least {datagram}, or {fit}.{when}")


def _widest(verdicts: Sequence[Verdict], datagram: int) -> int:
    """The largest size that passed every narrow way (0: none did)."""
    widest = datagram
    for v in verdicts:
        for ok, lost in ((v.up_ok, v.up_lost), (v.down_ok, v.down_lost)):
            if lost:
                widest = min(widest, max(ok, default=0))
    return widest


def reason_for_peers(verdicts: Sequence[Verdict], payload_bytes: int) -> str:
    """Why a narrow rank aborts its jobs, as its peers read it (the API takes 256
    characters: the whole story is in the narrow rank's own error)."""
    datagram = payload_bytes + _OVERHEAD
    widest = _widest(verdicts, datagram)
    passing = f" while {widest} B ones pass" if widest > _OVERHEAD else ""
    return (f"its path to the appliance loses this job's {datagram} B datagrams{passing} (a "
            "link between has a smaller MTU than both ends); that rank's error says what to "
            "change")


def targets_of(jobs: Sequence[JobInfo], rank: int) -> list[PathTarget]:
    """Every core of the `jobs` this rank has joined: each is probed apart (its port may hash
    onto another member of an ECMP group or a LAG)."""
    targets: list[PathTarget] = []
    for job in jobs:
        assert job.cookie is not None
        targets.extend(PathTarget((core.host, core.port), job.job_id, rank, job.cookie,
                                  job.epoch) for core in job.cores)
    return targets


def abort_jobs(jobs: Sequence[JobInfo], rank: int, verdicts: Sequence[Verdict],
               payload_bytes: int) -> None:
    """Abort `jobs` as `rank`, whose paths drop their datagrams (best effort, `ABORT_S`
    each): its peers fail at once saying why, where they would wait out their deadline for
    this rank's datagrams, or (had it left) hear only that it left."""
    reason = reason_for_peers(verdicts, payload_bytes)
    for job in jobs:
        with contextlib.suppress(ReductionError):
            rendezvous.abort(job, rank, reason, timeout_s=ABORT_S)


def probe_paths(transport: WorkerTransport, targets: Sequence[PathTarget], payload_bytes: int,
                clock: Callable[[], float] = time.monotonic) -> list[Verdict]:
    """Probe every target's path; the verdicts ([] when nothing could be said within
    `BUDGET_S`). Anything else that arrives meanwhile is dropped: before the first allreduce
    nothing else is due."""
    probe = PathProbe(targets, payload_bytes, clock())
    while (verdicts := probe.outcome(clock())) is None:
        for dest, datagram in probe.due(clock()):
            transport.send_raw(datagram, dest)
        transport.wait(max(0.0, probe.next_at() - clock()))
        transport.receive(lambda h, _payload, source: probe.answered(h, source))
    return verdicts


def check_paths(transport: WorkerTransport, jobs: Sequence[JobInfo], rank: int,
                payload_bytes: int) -> list[Verdict]:
    """Probe the path to every core of the `jobs` this rank has joined. Where one is narrow,
    abort the jobs, then raise `PathTooNarrow` (best effort: the error about the path is the
    one to raise). Its peers cannot finish a round without this rank's datagrams."""
    verdicts = probe_paths(transport, targets_of(jobs, rank), payload_bytes)
    if any(v.narrow for v in verdicts):
        abort_jobs(jobs, rank, verdicts, payload_bytes)
        raise narrow_error(rank, verdicts, payload_bytes)
    return verdicts


class PathWatch:
    """Probes again mid-job (sans-I/O): a switch port reconfigured under a running job, or a
    path failed over to a link of smaller MTU (a LAG member, a backup route), drops every
    datagram of the job from then on while heartbeats pass, and the job used to wait out its
    deadline (60 s) blaming the rank behind it. When this rank's rounds have taken no result
    for `STALL_S`, the watch probes its paths as at join (`PathProbe`, alongside the rounds),
    and a path found narrow is probed again at once to confirm it; after a sound verdict the
    next probe of the same stall starts twice as far into it (1, 2, 4, ... s), and a result
    starts over. Cheap where nothing is wrong: a probe is a round trip of a few datagrams per
    core, and a stall is usually a slow peer."""

    def __init__(self, targets: Callable[[], list[PathTarget]], payload_bytes: int) -> None:
        self._targets = targets  # (asked at each probe: the epoch moves)
        self._payload_bytes = payload_bytes
        self._probe: PathProbe | None = None
        self._stall = -1.0  # since when the stall probed last went without results
        self._gap = STALL_S  # how long into that stall the next probe starts
        self.probes = 0  # started (for tests and reports)
        self._suspect = False  # the last probe found a path narrow: this one confirms it

    def _gap_in(self, quiet_since: float) -> float:
        return self._gap if quiet_since == self._stall else STALL_S

    def next_at(self, quiet_since: float | None) -> float:
        """When `due` next has something to send, given since when the rounds in flight have
        taken no result (None: no round in flight)."""
        if self._probe is not None:
            return self._probe.next_at()
        return math.inf if quiet_since is None else quiet_since + self._gap_in(quiet_since)

    def due(self, now: float, quiet_since: float | None) -> list[tuple[Address, bytes]]:
        if self._probe is None:
            if quiet_since is None or now < self.next_at(quiet_since):
                return []
            self._gap, self._stall = self._gap_in(quiet_since), quiet_since
            self._probe = PathProbe(self._targets(), self._payload_bytes, now)
            self.probes += 1
        return self._probe.due(now)

    def answered(self, h: Header, source: Address) -> None:
        if self._probe is not None:
            self._probe.answered(h, source)

    def look(self, now: float, quiet_since: float | None,
             send: Callable[[bytes, Address], None]) -> list[Verdict] | None:
        """A turn: the confirmed narrow verdicts if a probe just gave them (`outcome`), else
        whatever probes are due, handed to `send`."""
        if (verdicts := self.outcome(now, quiet_since)) is None:
            for dest, datagram in self.due(now, quiet_since):
                send(datagram, dest)
        return verdicts

    def outcome(self, now: float, quiet_since: float | None) -> list[Verdict] | None:
        """The verdicts of a probe that just ended, if any were narrow and a second probe
        started at once agreed; else None. (Mid-job the job is aborted on them: one look could
        meet a queue that had room for small datagrams only through every try.) A result
        taken meanwhile (the stall is not the one probed) ends the probe without a verdict:
        the path carries the job's datagrams."""
        if self._probe is not None and quiet_since != self._stall:
            self._probe, self._suspect = None, False
            return None
        if self._probe is None or (verdicts := self._probe.outcome(now)) is None:
            return None
        self._probe = None
        if not any(v.narrow for v in verdicts):
            self._suspect = False
            self._gap *= 2
            return None
        if self._suspect:
            return verdicts
        self._suspect = True
        self._probe = PathProbe(self._targets(), self._payload_bytes, now)
        self.probes += 1
        return None
