"""Changes of a job (joins, leaves, resyncs) decided one at a time and sent to the cores in
batches (control/specbatch.py), and the appliance that uses them with a core that takes its
time (control/service.py), its lock free while the cores are at work."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.registry import Registry
from reduction_appliance.control.service import Appliance
from reduction_appliance.control.specbatch import SpecBatches
from reduction_appliance.control.supervisor import Supervisor
from reduction_appliance.dataplane.errors import NotFound
from reduction_appliance.dataplane.spec import JobSpec


class _Cores:
    """Sends the job as decided so far (a list of ranks standing for its spec)."""

    def __init__(self) -> None:
        self.lock, self.to_cores = threading.Lock(), threading.Lock()
        self.batches: SpecBatches[list[int]] = SpecBatches(self.lock, self.to_cores)
        self.decided: list[int] = []
        self.sends: list[list[int]] = []
        self.refuse = 0  # the next sends to refuse
        self.during_push: Any = None  # called inside the next push

    def join(self, rank: int) -> int:
        with self.lock:
            self.decided.append(rank)
            return self.batches.decided(1)

    def wait(self, ticket: int) -> list[int]:
        return self.batches.await_sent(1, ticket, lambda: list(self.decided), self._push)

    def _push(self, plan: list[int]) -> None:
        assert self.to_cores.locked()
        if self.during_push is not None:
            during, self.during_push = self.during_push, None
            during()
        if self.refuse:
            self.refuse -= 1
            raise NotFound("no job 1")
        self.sends.append(plan)


def _all_at_once(n: int, fn: Any) -> tuple[list[Any], list[BaseException]]:
    """`fn(i)` for i in range(n), each in its own thread, started together."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    go = threading.Barrier(n)

    def run(i: int) -> None:
        go.wait()
        try:
            results[i] = fn(i)
        except BaseException as exc:  # (collected for the test's asserts)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_joins_decided_meanwhile_go_to_the_cores_in_one_send() -> None:
    cores = _Cores()
    tickets = [cores.join(rank) for rank in range(32)]
    plans, errors = _all_at_once(32, lambda i: cores.wait(tickets[i]))
    assert not errors
    assert cores.sends == [list(range(32))]  # one send, every join in it
    assert all(rank in plan for rank, plan in enumerate(plans))


def test_each_join_returns_only_once_the_cores_have_it() -> None:
    cores = _Cores()

    def join_and_wait(rank: int) -> list[int]:
        plan = cores.wait(cores.join(rank))
        assert rank in cores.sends[-1] and rank in plan
        return plan

    _, errors = _all_at_once(24, join_and_wait)
    assert not errors
    assert sorted(cores.sends[-1]) == list(range(24))
    assert 1 <= len(cores.sends) <= 24


def test_joins_are_decided_while_a_push_is_on_its_way_and_go_in_the_next() -> None:
    """The sender pushes without the lock (a push of a big job takes milliseconds), holding
    `to_cores` instead, so that no later update of the job overtakes it."""
    cores = _Cores()
    first = cores.join(0)
    later: list[int] = []
    cores.during_push = lambda: later.extend(cores.join(r) for r in (1, 2))  # (takes the lock)
    assert cores.wait(first) == [0]
    assert [cores.wait(t) for t in later] == [[0, 1, 2], [0, 1, 2]]
    assert cores.sends == [[0], [0, 1, 2]]
    assert not cores.to_cores.locked()


def test_another_update_of_the_job_counts_as_its_send() -> None:
    """A resync or a leave sends the whole spec too: joins decided before it are in it."""
    cores = _Cores()
    ticket = cores.join(5)
    with cores.lock:
        cores.batches.sent(1, [5, 7])  # e.g. the resync of another rank
    assert cores.wait(ticket) == [5, 7]
    assert cores.sends == []


def test_a_refused_send_fails_its_own_join_and_the_next_waiter_sends_again() -> None:
    cores = _Cores()
    first, second = cores.join(0), cores.join(1)
    cores.refuse = 1
    with pytest.raises(NotFound):
        cores.wait(first)
    assert not cores.to_cores.locked()
    assert cores.wait(second) == [0, 1]
    assert cores.sends == [[0, 1]]
    # nothing is kept for a job no join waits on: a later send of it is not recorded...
    with cores.lock:
        cores.batches.sent(1, [9])
    # ...and the next join of it sends afresh
    assert cores.wait(cores.join(2)) == [0, 1, 2]


def test_a_call_that_changed_nothing_waits_only_for_changes_not_yet_sent() -> None:
    cores = _Cores()
    with cores.lock:
        assert cores.batches.pending(1) is None  # nothing on its way: answer at once
    ticket = cores.join(3)
    with cores.lock:
        waiting = cores.batches.pending(1)  # e.g. a resync that found the epoch moved already
    assert waiting == ticket
    assert cores.wait(ticket) == [3]
    assert cores.wait(waiting) == [3]
    assert cores.sends == [[3]]
    with cores.lock:
        assert cores.batches.pending(1) is None


class _SlowCores:
    """A supervisor whose update takes as long as a big job's does on a busy appliance."""

    def __init__(self) -> None:
        self.specs: list[JobSpec] = []
        self.removed: list[int] = []

    def add_job(self, spec: JobSpec) -> None:
        self.specs.append(spec)

    def update_job(self, spec: JobSpec) -> None:
        time.sleep(0.02)  # the workload: pickling, piping, comparing 4096 endpoints
        self.specs.append(spec)

    def remove_job(self, job_id: int, *, abort: str | None = None) -> None:
        self.removed.append(job_id)

    cores = (None,)  # one core, which answers for no job (so none is evicted)

    def stats(self, job_ids: tuple[int, ...]) -> list[object]:
        return []


def _joined(world: int) -> tuple[Appliance, _SlowCores, int]:
    supervisor = _SlowCores()
    appliance = Appliance(Registry(parse({"dataplane": {"slot_memory_mb": 64}})),
                          cast(Supervisor, supervisor))
    job_id = appliance.create_job({"name": "big", "world_size": world, "secret": "s"}).job_id
    for rank in range(world):
        appliance.join(job_id, {"rank": rank, "secret": "s", "address": "198.18.0.2",
                                "port": 20000 + rank})
    return appliance, supervisor, job_id


def test_the_appliance_sends_concurrent_joins_in_batches_and_answers_each_with_its_rank() -> None:
    supervisor = _SlowCores()
    appliance = Appliance(Registry(parse({"dataplane": {"slot_memory_mb": 64}})),
                          cast(Supervisor, supervisor))
    job = appliance.create_job({"name": "big", "world_size": 48, "secret": "s"})
    answers, errors = _all_at_once(48, lambda rank: appliance.join(job.job_id, {
        "rank": rank, "secret": "s", "address": "198.18.0.2", "port": 20000 + rank}))
    assert not errors
    updates = supervisor.specs[1:]
    # Every join is decided during the first update (the lock is free while the cores take
    # it), so the second carries the rest: 2 in every run here, idle or with two busy loops
    # beside it. Before, the sender held the lock and batches followed the threads' turns for
    # it (3 to 17 updates); one per join before that.
    assert len(updates) <= 8, f"{len(updates)} core updates for 48 joins"
    assert all(e == ("198.18.0.2", 20000 + r) for r, e in enumerate(updates[-1].endpoints))
    for rank, answer in enumerate(answers):
        assert answer.cookie == updates[-1].cookie and rank in answer.joined


def test_ranks_leaving_together_are_sent_in_batches_and_the_last_ends_the_job() -> None:
    """The leaves still waiting for their update when the last rank's leave ends the job have
    nothing left to tell: they succeed."""
    appliance, supervisor, job_id = _joined(48)
    before = len(supervisor.specs)
    answers, errors = _all_at_once(48, lambda rank: appliance.leave(job_id, {
        "rank": rank, "secret": "s"}))
    assert not errors
    # 1 in every run here (2 to 24 while the sender held the lock; one per leave before)
    assert len(supervisor.specs) - before <= 8
    assert supervisor.removed == [job_id] and appliance.jobs() == []
    assert {a.state for a in answers} >= {"done"}
    assert all(spec.departed <= frozenset(range(48)) for spec in supervisor.specs[before:])


def test_ranks_that_resync_together_move_the_epoch_once_and_send_it_once() -> None:
    appliance, supervisor, job_id = _joined(16)
    epoch = appliance.registry.get(job_id).spec.epoch
    before = len(supervisor.specs)
    answers, errors = _all_at_once(16, lambda rank: appliance.resync(job_id, {
        "secret": "s", "epoch": epoch}))
    assert not errors
    moved = supervisor.specs[before:]
    assert len(moved) == 1 and moved[0].epoch != epoch
    assert all(a.epoch == moved[0].epoch for a in answers)


def _answers_meanwhile(appliance: Appliance) -> tuple[threading.Event, Any]:
    """An event, and a function that lists the appliance's jobs from another thread and sets
    the event if that returns within 10 s (where the lock is held, it waits for the caller)."""
    answered = threading.Event()

    def listed() -> None:
        appliance.jobs()
        answered.set()

    def ask() -> None:
        lister = threading.Thread(target=listed)
        lister.start()
        lister.join(10)

    return answered, ask


def test_the_appliance_answers_other_calls_while_the_cores_take_an_update() -> None:
    """A big job's update takes the cores milliseconds; the appliance's lock is not held for
    it, so status, listings and other jobs' calls go on meanwhile."""
    appliance, supervisor, job_id = _joined(2)
    answered, ask = _answers_meanwhile(appliance)
    slow_update = supervisor.update_job

    def update_job(spec: JobSpec) -> None:
        ask()
        slow_update(spec)

    supervisor.update_job = update_job  # type: ignore[method-assign]
    appliance.leave(job_id, {"rank": 0, "secret": "s"})
    assert answered.is_set()


def test_the_appliance_answers_other_calls_while_eviction_asks_the_cores() -> None:
    """The janitor's pass asks every core about every job each second, and a busy core takes
    its time to answer: joins and leaves do not wait for it."""
    appliance, supervisor, _ = _joined(2)
    answered, ask = _answers_meanwhile(appliance)

    def stats(job_ids: tuple[int, ...]) -> list[object]:
        ask()
        return []

    supervisor.stats = stats  # type: ignore[method-assign]
    assert appliance.evict_idle() == []
    assert answered.is_set()
