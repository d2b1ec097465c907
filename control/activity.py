"""What the cores saw of each job, merged: status, metrics and eviction read a job through it.

Each core reports its own view of a job (`CoreStats`); a rank is silent only if every core
says so, and heartbeats go to one core per appliance, so the merge needs every core's word.
Pure: the service asks the cores and hands their answers here."""

from __future__ import annotations

from reduction_appliance.dataplane.spec import Address, CoreStats
from reduction_appliance.dataplane.wire import number_before

__all__ = ["Activity", "merged"]


class Activity:
    """One job as every core that answered for it saw it."""

    __slots__ = ("bytes_reduced", "diverged", "elsewhere", "ended", "heard", "job_id", "lagging",
                 "last_activity", "lost", "missed", "quiet_s", "reports", "rounds",
                 "segments_reduced", "silent_votes")

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.diverged: str | None = None
        self.silent_votes: list[dict[int, float]] = []  # per core: rank -> seconds silent
        self.rounds = 0
        self.bytes_reduced = 0
        self.segments_reduced = 0
        self.last_activity: float | None = None
        self.quiet_s: float | None = None  # since any core last heard any rank
        self.reports = 0  # how many cores answered for the job
        self.lagging: dict[int, float] = {}
        self.heard: dict[int, float] = {}  # rank -> seconds since any core heard it
        self.elsewhere: dict[int, Address] = {}  # rank -> another source its datagrams had
        self.ended: set[int] = set()  # ranks a core found ended (dataplane.reach)
        self.missed: dict[int, int] = {}  # rank -> its contributions that never came, all cores
        self.lost: dict[int, int] = {}  # rank -> results it is known to have lost, all cores

    @property
    def silent(self) -> dict[int, float]:
        """Ranks every core finds silent, for as long as the core that heard them last."""
        if not self.silent_votes:
            return {}
        ranks = set.intersection(*(set(v) for v in self.silent_votes))
        return {r: min(v[r] for v in self.silent_votes) for r in sorted(ranks)}


def merged(ids: tuple[int, ...], per_core: list[CoreStats]) -> list[Activity]:
    """Each job's activity over every core that answered for it (`per_core`)."""
    out = []
    for job_id in ids:
        act = Activity(job_id)
        for core in per_core:
            core_now = core.now
            st = core.jobs.get(job_id)
            if st is None:
                continue
            # The newest (round numbers wrap; 0: none yet).
            if not act.rounds or number_before(act.rounds, st.rounds):
                act.rounds = st.rounds
            act.bytes_reduced += st.bytes_reduced
            act.segments_reduced += st.segments_reduced
            if st.last_activity is not None:
                act.last_activity = max(act.last_activity or 0.0, st.last_activity)
            for rank, since in st.waiting.items():
                act.lagging[rank] = max(act.lagging.get(rank, 0.0), core_now - since)
            act.diverged = act.diverged or st.diverged
            for rank, ago in st.heard.items():  # the core that heard it last
                act.heard[rank] = min(act.heard.get(rank, ago), ago)
            act.elsewhere.update(st.elsewhere)
            act.ended.update(st.ended)  # (found by a core a slot of which waits for it)
            for rank, n in st.missed_from.items():
                act.missed[rank] = act.missed.get(rank, 0) + n
            for rank, n in st.lost_to.items():
                act.lost[rank] = act.lost.get(rank, 0) + n
            # Heartbeats go to one core per appliance: a rank is silent only if every
            # core says so, for as long as the one that heard it last.
            act.silent_votes.append(st.silent)
            act.reports += 1
            if st.quiet_s is not None:  # the core that heard the job last
                act.quiet_s = min(st.quiet_s, act.quiet_s if act.quiet_s is not None
                                  else st.quiet_s)
        out.append(act)
    return out
