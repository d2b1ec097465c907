"""How a job reads on the operator's screen (`reductionctl status`): its row and what is wrong
with it, one line per finding.

A job of a thousand ranks that lost a rack has hundreds of silent ranks: a line per rank buried
the screen (benchmarks-journal.md, "A job of a thousand ranks"). Past `LISTED` ranks with the
same finding, one line says how many and which (`format_ranks`: runs, "0-511"); `--json` keeps
every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reduction_appliance.dataplane.units import format_ranks, format_size

__all__ = ["LISTED", "LOSSY_SHARE", "age", "fit", "held_windows", "job_lines", "joined_from",
           "losses", "render_job", "shared_hosts"]

LISTED = 8  # ranks with one finding listed a line each; past it, one line for them all
_LAGGING = 4  # ranks shown in the lagging column, the longest waited for first
_ENDED = ("ended: its host says nothing listens there any more (killed, crashed or exited "
          "without leaving)")
_ENDED_ALL = ("ended: their hosts say nothing listens there any more (killed, crashed or "
              "exited without leaving)")


# A rank losing at least this share of its contributions or results is named in the status.
# A clean cable loses next to none (on the emulated rack, the clean ranks beside a bad cable
# counted none: the workers' other repairs are queries after late or unread results, which
# neither counts); a bad one stands far above it.
LOSSY_SHARE = 0.01


def losses(job: dict[str, Any]) -> list[tuple[int, int, int, float | None]]:
    """Per rank with any loss, most first: (rank, its contributions that never came, results
    it lost on their way, the larger of the two as a share of the job's segments; None before
    any segment completed). Each rank sends one contribution to every segment and gets its
    result, so the segments are both counts' denominator."""
    missed = {int(r): n for r, n in job.get("contributions_missed", {}).items()}
    lost = {int(r): n for r, n in job.get("results_lost", {}).items()}
    segments = job.get("segments_reduced", 0)
    rows = [(r, missed.get(r, 0), lost.get(r, 0),
             max(missed.get(r, 0), lost.get(r, 0)) / segments if segments else None)
            for r in missed.keys() | lost.keys()]
    return sorted(rows, key=lambda row: (-max(row[1], row[2]), row[0]))


def shared_hosts(job: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """The addresses that several of a job's ranks joined from, with those ranks, where the
    job spans two addresses or more: each such rank sends its whole tensor through its host's
    one link (a torch group reduces on the host first unless told not to; numpy clients do
    not). A job whose ranks are all at one address has no link between them to spare."""
    by_host: dict[str, list[int]] = {}
    for rank, endpoint in job.get("endpoints", {}).items():
        by_host.setdefault(str(endpoint).rsplit(":", 1)[0], []).append(int(rank))
    if len(by_host) < 2:
        return []
    return sorted(((host, sorted(ranks)) for host, ranks in by_host.items() if len(ranks) > 1),
                  key=lambda shared: shared[1][0])


def held_windows(job: dict[str, Any]) -> list[tuple[int, list[int]]]:
    """The windows that joined ranks' hosts hold them to (their receive buffers are capped:
    plugin/hostchecks.py), each with the ranks held there, the smallest first."""
    by_window: dict[int, list[int]] = {}
    for rank, window in job.get("windows_held", {}).items():
        by_window.setdefault(int(window), []).append(int(rank))
    return sorted((w, sorted(ranks)) for w, ranks in by_window.items())


def _loss_words(missed: int, lost: int, share_of: int) -> str:
    def share(n: int) -> str:
        return f" ({n / share_of:.1%})" if share_of else ""
    return (f"{missed} contribution{'s' * (missed != 1)} never came{share(missed)}, "
            f"{lost} result{'s' * (lost != 1)} lost on the way to it{share(lost)}")


def joined_from(job: dict[str, Any], rank: Any) -> Any:
    """Where `rank` of a status entry joined from (its keys are strings in JSON)."""
    endpoints = job.get("endpoints", {})
    return endpoints.get(str(rank)) or endpoints.get(rank)


def job_lines(j: dict[str, Any], wide: int) -> list[str]:
    """A job's row of the status table (`wide`: its name column), then its findings."""
    lagging = sorted(j["lagging"].items(), key=lambda rw: (-rw[1], int(rw[0])))
    lag = ", ".join(f"{r} ({w:.1f}s)" for r, w in lagging[:_LAGGING]) or "-"
    if len(lagging) > _LAGGING:
        lag += f", and {len(lagging) - _LAGGING} more"
    lines = [
        f"{j['job_id']:>4} {fit(j['name'], wide):<{wide}} {j['state']:<8} "
        f"{j['world_size']:>5} "
        f"{len(j['joined']):>6} {j.get('epoch', 1):>5} {j['rounds']:>7} "
        f"{format_size(j['bytes_reduced']):>10} "
        f"{age(j['last_activity_s']):>14}  {lag}"
        + ("  [roce]" if j.get("transport") == "roce" else "")]
    notes = [str(d) for d in j.get("disruptions", [])]
    if j.get("diverged"):
        notes.append(str(j["diverged"]))
    notes += _each_or_all(
        [(int(rank), f"rank {rank} ({joined_from(j, rank)}): its datagrams came from {source} "
                     "(a NAT between it and the appliance?), dropped")
         for rank, source in j.get("seen_elsewhere", {}).items()],
        lambda ranks: f"{len(ranks)} ranks' datagrams came from other addresses than they "
                         f"joined from (a NAT between them and the appliance?), dropped: "
                         f"ranks {format_ranks(ranks)}")
    lossy = [(rank, f"rank {rank} ({joined_from(j, rank)}) loses datagrams: "
                    + _loss_words(missed, lost, j["segments_reduced"]))
             for rank, missed, lost, share in losses(j)
             if share is not None and share >= LOSSY_SHARE]  # the most first
    notes += [text for _, text in lossy[:LISTED]]
    if len(lossy) > LISTED:
        notes.append(f"and {len(lossy) - LISTED} more ranks lose datagrams: ranks "
                     f"{format_ranks(rank for rank, _ in lossy[LISTED:])}")
    for host, ranks in shared_hosts(j):
        notes.append(f"ranks {format_ranks(ranks)} share {host}: each sends its whole tensor "
                     "through that host's link (torch groups reduce on the host first unless "
                     "REDUCTION_HIERARCHY=flat or deterministic)")
    for window, ranks in held_windows(j):
        who = (f"rank {ranks[0]} holds its windows" if len(ranks) == 1 else
               f"ranks {format_ranks(ranks)} hold their windows")
        notes.append(f"{who} to {window} of {j['slots_per_core']} slots a core: "
                     f"{'its host caps' if len(ranks) == 1 else 'their hosts cap'} UDP receive "
                     "buffers (net.core.rmem_max, workers not root). There: "
                     "sysctl -w net.core.rmem_max=67108864 net.core.wmem_max=67108864")
    notes += _silent_notes(j)
    return lines + [f"     ! {note}" for note in notes]


def _silent_notes(j: dict[str, Any]) -> list[str]:
    """The ranks the cores have not heard for the liveness timeout (or that ended or left
    while a round waits for them), by what became of them."""
    ended, joined = {int(r) for r in j.get("ended", ())}, {int(r) for r in j["joined"]}
    silent = {int(r): s for r, s in j.get("silent", {}).items()}
    gone = [(r, s) for r, s in silent.items() if r in ended]
    quiet = [(r, s) for r, s in silent.items() if r not in ended and r in joined]
    left = [(r, s) for r, s in silent.items() if r not in ended and r not in joined]

    def spread(ranks: list[int]) -> str:
        lo, hi = min(silent[r] for r in ranks), max(silent[r] for r in ranks)
        return f"{lo:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f} s"

    def each_or_all(rows: list[tuple[int, float]], one: str, all_: str) -> list[str]:
        return _each_or_all(
            [(r, one.format(rank=r, where=joined_from(j, r), s=s)) for r, s in rows],
            lambda ranks: all_.format(n=len(ranks), s=spread(ranks),
                                         ranks=format_ranks(ranks)))

    return (each_or_all(gone, "rank {rank} ({where}) silent for {s:.1f} s, " + _ENDED,
                        "{n} ranks silent for {s}, " + _ENDED_ALL + ": ranks {ranks}")
            + each_or_all(quiet, "rank {rank} ({where}) silent for {s:.1f} s",
                          "{n} ranks silent for {s}: ranks {ranks}")
            + each_or_all(left, "rank {rank} ({where}) left {s:.1f} s ago",  # a round waits
                          "{n} ranks left {s} ago: ranks {ranks}")
            + _each_or_all([(r, f"rank {r} ({joined_from(j, r)}) {_ENDED}")
                            for r in sorted(ended - silent.keys())],
                           lambda ranks: f"{len(ranks)} ranks {_ENDED_ALL}: ranks "
                                            f"{format_ranks(ranks)}"))


def render_job(job: dict[str, Any], live: dict[str, Any]) -> str:
    """One job for `reductionctl jobs ID`: its registration (`job`, GET /v1/jobs/ID) and what
    the cores saw of it (`live`, its entry in /v1/status; empty if none)."""
    def ranks(table: dict[str, Any], fmt: Callable[[Any], str]) -> str:
        return ", ".join(f"{r}: {fmt(v)}" for r, v in sorted(
            table.items(), key=lambda kv: int(kv[0]))) or "-"

    mc = job.get("multicast")
    rows = [
        ("job", f"{job.get('job_id')} {job.get('name')} ({job.get('state')}, epoch "
                f"{live.get('epoch', job.get('epoch', 1))})"),
        ("ranks", f"{len(job.get('joined', []))} of {job.get('world_size')} joined "
                  f"[{format_ranks(job.get('joined', []), 32)}]"
                  + (", deterministic" if job.get("deterministic") else "")),
        ("cores", ", ".join(f"{c['host']}:{c['port']} ({c['slots']} slots)"
                            for c in job.get("endpoints", [])) or "-"),
        ("segments", f"{job.get('segment_bytes')} bytes, results "
                     + (f"multicast to {mc['group']}:{mc['port']}" if mc else "by unicast")),
        ("reduced", f"{live.get('rounds', 0)} rounds, "
                    f"{format_size(live.get('bytes_reduced', 0))}, last "
                    f"{age(live.get('last_activity_s'))}"),
        ("joined from", ranks(live.get("endpoints", {}), str)),
        ("last heard", ranks(live.get("heard_s", {}), lambda s: f"{s:.1f}s ago")),
        ("waited for", ranks(live.get("lagging", {}), lambda s: f"{s:.1f}s")),
        ("lost", "; ".join(f"rank {rank}: " + _loss_words(missed, lost,
                                                          live.get("segments_reduced", 0))
                           for rank, missed, lost, _ in losses(live)) or "-"),
    ]
    rows += [("! elsewhere", ranks(live["seen_elsewhere"], str))] \
        if live.get("seen_elsewhere") else []
    rows += [("! diverged", str(live["diverged"]))] if live.get("diverged") else []
    return "\n".join(f"{key:>12}: {value}" for key, value in rows)


def _each_or_all(rows: list[tuple[int, str]], summary: Callable[[list[int]], str]) -> list[str]:
    """A line per rank (`rows`: rank, its line), or past `LISTED` of them one `summary` of
    their ranks."""
    if len(rows) <= LISTED:
        return [text for _, text in rows]
    return [summary(sorted(rank for rank, _ in rows))]


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:  # (a moment ago can round to -0.0 on the daemon's side)
        return f"{max(seconds, 0.0):.1f}s ago"
    return f"{seconds / 60:.0f}m ago"


def fit(name: str, width: int) -> str:
    """`name` in `width` characters: a longer one keeps its start and end."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return f"{name[:head]}~{name[len(name) - (width - 1 - head):]}"
