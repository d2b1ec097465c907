"""Aborted jobs, remembered for a while: so that a rank of an aborted run that comes late is
told why its run ended, instead of being given a fresh job to wait in.

A job is aborted by an operator or by one of its ranks (one that found the job cannot go on:
a path narrower than its datagrams), and its joined ranks are told at once. A rank that had
not joined yet is not: one that started late registered the job's name after the abort, found
no job of that name, created a new one and waited there for peers that had all gone, until its
deadline (60 s; under torch, the process group's 30 minutes). That flaked a CI run.

So the registry remembers each aborted job (by id, and the last one by name) for
`jobs.deadline_s`, and a job registered in that time under the same name, spec and secret is
marked as registered after it (`Registry.plan`). Its first rank to join tells the two cases
apart: a rank the aborted job had seen joined is its run restarted (a launcher's restart: the
mark is dropped and the job goes on), any other is the old run's late rank, refused with the
abort's reason (`JobGone`, 410), and the job it made is withdrawn. A request naming the
aborted job's id is answered the same way.

The one case taken wrongly: a restart within that time, with the same name, spec and secret,
whose first rank to join is one the aborted job never saw (that run had a late rank too). It is
refused with the abort's reason. The torch plugin makes a new secret for each run unless one is
configured (REDUCTION_JOB_SECRET), and a new secret is a new run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .jobplan import JobRequest

__all__ = ["AbortMemory", "Aborted"]


@dataclass(frozen=True)
class Aborted:
    """One aborted job, as the registry remembers it."""

    job_id: int
    request: JobRequest  # its name and spec: a late rank registers the same
    secret: str
    seen: frozenset[int]  # ranks that joined it at some time
    reason: str  # what its ranks were told
    at: float  # the registry clock when aborted

    def told(self) -> str:
        """The job's end, as a request that came after it is told."""
        return f"job {self.job_id} ({self.request.name!r}) was aborted ({self.reason})"


class AbortMemory:
    """Aborted jobs of the last `keep_s` (the registry's clock), by id and by name."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._by_id: dict[int, Aborted] = {}  # in the order aborted (the clock's order)
        self._by_name: dict[str, Aborted] = {}  # the last one of each name

    def __len__(self) -> int:
        return len(self._by_id)

    def remember(self, gone: Aborted, *, as_run: bool = True) -> None:
        """`as_run` False: by id only (a late rank's job, withdrawn: its name stays the aborted
        run's, whose `seen` tells a restart from another late rank)."""
        self._forget_before(gone.at - self.keep_s)
        self._by_id[gone.job_id] = gone
        if as_run:
            self._by_name[gone.request.name] = gone

    def of_id(self, job_id: int) -> Aborted | None:
        """The aborted job `job_id`, if remembered (possibly a little past `keep_s`: it is
        forgotten when the clock is next read, and is no less aborted for that)."""
        return self._by_id.get(job_id)

    def of_run(self, request: JobRequest, now: float) -> Aborted | None:
        """The last job of `request`'s name aborted in the last `keep_s`, where its spec was
        `request` too (the caller compares the secrets)."""
        self._forget_before(now - self.keep_s)
        gone = self._by_name.get(request.name)
        return gone if gone is not None and gone.request == request else None

    def _forget_before(self, oldest: float) -> None:
        while self._by_id:
            first = next(iter(self._by_id.values()))
            if first.at >= oldest:
                return
            del self._by_id[first.job_id]
            if self._by_name.get(first.request.name) is first:
                del self._by_name[first.request.name]

