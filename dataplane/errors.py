"""Errors, split by whose fault they are. Everything raised derives from `ReductionError`.

* The peer's fault (a malformed, forged or stale datagram) is never raised out of the data
  plane: it is counted under a `Drop` reason and dropped. `PeerError` names that family where
  code outside the hot path must still say it (a capture that does not decode).
* The caller's fault is a `RequestError`: the API answers it with its `status` (4xx) and the
  message, which says what to change.
* A temporary state of the appliance is `Unavailable` (503): retry later.
* Ours: `ConfigError` (the operator's file: fix it), `CoreFailure` (a data-plane core failed a
  request it should have served: a bug, answered 500 and logged), and anything else.
* What a worker hears about a collective: `AllreduceTimeout`, `JobAborted`.

Exceptions cross the control/core process boundary by class name (`by_name`), so a core's
refusal reaches the API as the same class it raised.
"""

from __future__ import annotations

__all__ = [
    "AdmissionError",
    "AllreduceTimeout",
    "ApplianceEnded",
    "ApplianceSilent",
    "BadRequest",
    "ConfigError",
    "Conflict",
    "CoreFailure",
    "Forbidden",
    "JobAborted",
    "JobDiverged",
    "JobResynchronised",
    "NotFound",
    "PathTooNarrow",
    "PeerError",
    "RankEnded",
    "RankHeld",
    "RankLeft",
    "RankSilent",
    "ReductionError",
    "RequestError",
    "Unavailable",
    "by_name",
]


class ReductionError(Exception):
    """Base of every error this project raises."""


class PeerError(ReductionError):
    """A datagram from a peer that is not ours or is malformed: counted and dropped, never
    raised out of the data plane."""


class RequestError(ReductionError):
    """The caller asked for something wrong; the message says what. Answered with `status`,
    and with `retry_after_s` where the same request may pass that much later."""

    status = 400
    retry_after_s: float | None = None


class BadRequest(RequestError):
    """A request that does not parse or names an invalid value (400)."""


class Forbidden(RequestError):
    """The request needs a credential the caller did not give (a job's join secret) (403)."""

    status = 403


class NotFound(RequestError):
    """The request names something that does not exist (404)."""

    status = 404


class Conflict(RequestError):
    """The request conflicts with the current state of what it names (409)."""

    status = 409


class RankHeld(Conflict):
    """A join names a rank that another endpoint holds, and the appliance heard that endpoint
    less than the liveness timeout ago (409). If it stays silent, the rank is free to take over
    after `retry_after_s` (a worker restarted by a launcher waits that long and joins again)."""

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s: float | None = retry_after_s


class AdmissionError(RequestError):
    """A job does not fit the appliance (slot memory, buffers, cores); the message says which
    budget. Ask for less, or wait for other jobs to finish (409)."""

    status = 409


class Unavailable(ReductionError):
    """The appliance cannot serve this right now (a core restarting, shutting down); retry."""


class ConfigError(ReductionError):
    """A configuration value is unusable; the message names the key and why. Fix the config."""


class CoreFailure(ReductionError):
    """A data-plane core failed a request with an error it should never raise: our bug. The
    message carries the core's exception class and text."""


class AllreduceTimeout(ReductionError):
    """An allreduce got no result for its deadline (one still getting results goes on). The
    message names the appliance endpoints that did not answer and, when the appliance told us,
    the ranks it was still waiting for. The job's other workers are usually the cause (crashed,
    stalled, or partitioned); retrying is safe."""


class JobAborted(ReductionError):
    """The appliance removed the job (an operator's abort, idle eviction or its shutdown) and
    said so; or this rank joined after its peers aborted it (control/aborts.py). Register the
    job again to continue."""


class RankSilent(ReductionError):
    """A rank of the job has been silent longer than the liveness timeout (its process died,
    its host or its network is gone): the message names it, its endpoint and for how long.
    The job cannot finish an allreduce without it; a restarted rank re-joins (`rejoin`)."""


class RankLeft(RankSilent):
    """A rank of the job left it (its worker closed its client or process group and said so)
    while this rank's allreduce waits for it: it was stopped before that allreduce, or the
    ranks made different numbers of allreduce calls (uneven inputs across ranks). Reported at
    once, not after the liveness timeout."""


class RankEnded(RankSilent):
    """A rank's process ended without leaving the job (killed, by the OOM killer or a
    scheduler, crashed, or exited; or its client was closed without leaving) while this rank's
    allreduce waits for it: it fell silent, and its host answered that nothing listens at its
    endpoint any more (dataplane.reach). Reported about a second after its end, not after the
    liveness timeout."""


class ApplianceSilent(ReductionError):
    """An appliance (or the network to it) has not answered for longer than the liveness
    timeout: the message names it. Restart it, or register the job elsewhere."""


class ApplianceEnded(ApplianceSilent):
    """An appliance's daemon is no longer running (crashed, killed, or stopped) while this
    rank's allreduce waits on it: its cores fell silent, and its API refuses connections
    (plugin.silence). Its jobs went with it, for good. Reported about a second after its end,
    not after the liveness timeout."""


class PathTooNarrow(ReductionError):
    """The path between this worker and an appliance drops the job's datagrams while small ones
    pass (a link between with a smaller MTU than both ends): found when the worker joined, by
    probes of several sizes each way. The message says which sizes passed; raise that link's
    MTU, or lower the appliance's `dataplane.mtu` to what passes."""


class JobDiverged(ReductionError):
    """The ranks of the job disagree on what they reduce (they called allreduce with another
    op, dtype or size, or a round was lost or skipped on some of them): the message says where
    and which. Every rank is told; nothing is summed until the job is resynchronised
    (`ApplianceClient.resync()`, or a rank re-joining)."""


class JobResynchronised(ReductionError):
    """The job moved to a new epoch (a rank re-joined) while this round had results already:
    the round is lost. Rounds after it run normally."""


def by_name(name: str) -> type[ReductionError] | None:
    """The `ReductionError` subclass called `name` (any module), or None."""
    pending: list[type[ReductionError]] = [ReductionError]
    while pending:
        cls = pending.pop()
        if cls.__name__ == name:
            return cls
        pending.extend(cls.__subclasses__())
    return None
