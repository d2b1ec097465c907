"""A real reductiond on the host's loopback (no root) and numpy workers: what the daemon does
with ranks that are gone (or never agree). Workers that pause longer than the idle timeout
between all_reduces keep their job (they heartbeat); workers gone without leaving free it
within two liveness timeouts; a restarted worker takes over its rank once the old one is
silent for one; a rank that comes after its peers aborted the job is told why at once."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from reduction_appliance.client import (
    AllreduceTimeout,
    ApplianceClient,
    JobAborted,
    RankEnded,
    RankLeft,
    ReductionError,
    RendezvousError,
    register,
)
from reduction_appliance.control.apiclient import UnixApi
from reduction_appliance.control.ctl import render_status
from reduction_appliance.deploy.testnet.harness import local_daemon
from reduction_appliance.plugin import rendezvous
from reduction_appliance.plugin.rendezvous import leave
from reduction_appliance.plugin.rtt import Timing
from reduction_appliance.plugin.transport import UdpWorkerTransport
from tests.capabilities import needs_raw_icmp
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # a real daemon and its data-plane process: seconds

IDLE_TIMEOUT_S = 3.0  # longer than the abandonment, which must come first
LIVENESS_S = 1.0  # workers heartbeat every 0.1 s; a job of silent ranks goes after 2 s


def _free_udp_ports(count: int) -> int:
    """The first of `count` consecutive UDP ports free on loopback just now (core i binds
    base_port + i)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as first:
            first.bind(("127.0.0.1", 0))
            base = int(first.getsockname()[1])
            if base + count > 65536:
                continue
            others = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count - 1)]
            try:
                for i, s in enumerate(others, start=1):
                    s.bind(("127.0.0.1", base + i))
                return base
            except OSError:
                continue
            finally:
                for s in others:
                    s.close()


def _config(cores: int = 1) -> dict[str, Any]:
    return {
        "dataplane": {"address": "127.0.0.1", "base_port": _free_udp_ports(cores), "cores": cores,
                      "cpus": [], "kernels": "numpy", "slot_memory_mb": 4, "mtu": 9000},
        "multicast": {"enabled": False},
        "jobs": {"idle_timeout_s": IDLE_TIMEOUT_S, "liveness_timeout_s": LIVENESS_S},
        "api": {"listen": "127.0.0.1:0"},
    }


@pytest.mark.parametrize("cores", [1, 2])
def test_a_pausing_job_stays_and_an_abandoned_one_is_evicted_at_once(cores: int) -> None:
    """With two cores, heartbeats reach the first only: the second's view (every rank silent
    while no data flows) must not evict the job."""
    with local_daemon(_config(cores)) as daemon:
        api = UnixApi(daemon.unix_socket)

        def jobs() -> list[dict[str, Any]]:
            listed: list[dict[str, Any]] = api.get("/v1/jobs")
            return listed

        def quiet_for() -> float:
            listed = api.get("/v1/status")["jobs"]  # none: evicted (the assert below says so)
            return float(listed[0]["last_activity_s"] or 0.0) if listed else float("inf")

        info = register(daemon.api, "pausing", world_size=1, secret="secret-of-the-test")
        with ApplianceClient([info], 0, local_address="127.0.0.1") as client:
            grads = np.ones(5000, np.float32)
            client.allreduce(grads)
            # An evaluation pass: no all_reduce for longer than the idle timeout (and the
            # liveness timeout), the worker alive. It once evicted the job after the idle
            # timeout, and the next all_reduce raised JobAborted.
            wait_until(lambda: quiet_for() > IDLE_TIMEOUT_S + 1.5, 20,
                       what="the job quiet past the idle timeout")
            assert [j["name"] for j in jobs()] == ["pausing"]
            client.allreduce(grads)
            assert np.array_equal(grads, np.ones(5000, np.float32))
        # The client closed without leaving: its process might as well have died. The job goes
        # within two liveness timeouts (and the janitor's second), not the idle timeout's.
        wait_until(lambda: not jobs(), 15, what="the abandoned job evicted")
        wait_until(lambda: "evicted job" in daemon.stderr.text(), 5, what="the log line")
        line = next(x for x in daemon.stderr.text().splitlines() if "evicted job" in x)
        assert "(pausing): every joined rank silent for" in line, line
        assert api.get("/v1/status")["jobs_evicted"] == {"idle": 0, "abandoned": 1}


def test_a_restarted_worker_takes_its_rank_over_once_the_old_one_is_silent() -> None:
    """A worker restarted by a launcher (torchrun) joins again without `rejoin`, at once: the
    appliance refuses while its predecessor may be alive and says for how long, the join waits
    that out and takes the rank over, and the job goes on with the rank that stayed."""
    with local_daemon(_config()) as daemon:
        secret = "secret-of-the-test"
        info = register(daemon.api, "restart", world_size=2, secret=secret)
        with ApplianceClient([info], 1, local_address="127.0.0.1") as stays:
            crashed = ApplianceClient([info], 0, local_address="127.0.0.1")
            crashed.close()  # no leave: as if its process died
            again = register(daemon.api, "restart", world_size=2, secret=secret)
            # Joined at once, before the old endpoint counts as gone: refused with the time
            # left (409, retry_after_s), the join waits it out and takes rank 0 over.
            with ApplianceClient([again], 0, local_address="127.0.0.1") as successor:
                assert successor.pipeline.epoch == 2
                # The rank that stayed was idle: its socket holds answers saying rank 0 is
                # silent, then the new epoch. It reads them before its round starts (the
                # stale ones once failed that round with RankSilent).
                grads = [np.full(3000, 1.0, np.float32), np.full(3000, 2.0, np.float32)]
                other = threading.Thread(target=stays.allreduce, args=(grads[1],))
                other.start()
                successor.allreduce(grads[0])
                other.join(30)
                assert not other.is_alive()
                for g in grads:
                    assert np.array_equal(g, np.full(3000, 3.0, np.float32))


def test_a_name_whose_workers_are_gone_is_taken_by_a_new_registration() -> None:
    """A launcher that restarts a job's workers registers its name again with a new secret
    (here another world size too). While the old job's workers live, that is refused at once
    (409, no wait offered); once none has been heard for the liveness timeout, the old job is
    evicted and the name is the new registration's."""
    with local_daemon(_config()) as daemon:
        api = UnixApi(daemon.unix_socket)
        old = register(daemon.api, "relaunched", world_size=1, secret="first-incarnation")
        with ApplianceClient([old], 0, local_address="127.0.0.1"):
            with pytest.raises(RendezvousError, match="exists with world_size 1") as refused:
                register(daemon.api, "relaunched", world_size=2, secret="second-incarnation",
                         timeout_s=5)
            assert "still held" not in str(refused.value)  # live: no waiting
        # The worker is gone without leaving.
        wait_until(lambda: "0" in api.get("/v1/status")["jobs"][0]["silent"], 10,
                   what="rank 0 silent")
        new = register(daemon.api, "relaunched", world_size=2, secret="second-incarnation",
                       timeout_s=5)
        assert new.job_id != old.job_id and new.world_size == 2
        assert [j["job_id"] for j in api.get("/v1/jobs")] == [new.job_id]
        # (the daemon's stderr is read by a thread of the harness: the line may still be on
        # its way)
        wait_until(lambda: "registered again, every rank silent for" in daemon.stderr.text(),
                   5, what="the log line of the eviction by registration")
        assert api.get("/v1/status")["jobs_evicted"]["abandoned"] == 1


def test_a_job_whose_ranks_left_before_the_rest_came_frees_its_name() -> None:
    """Rank 0 joined, and left when rank 1 never came (it failed on its host). The job once
    stayed, holding its slots and refusing the restarted workers' new secret (403) for the
    idle timeout: eviction of an abandoned job counts joined ranks, and none was left."""
    with local_daemon(_config()) as daemon:
        api = UnixApi(daemon.unix_socket)
        first = register(daemon.api, "half-started", world_size=2, secret="first-incarnation")
        with ApplianceClient([first], 0, local_address="127.0.0.1") as client:
            pass
        leave(client.jobs[0], 0)
        assert api.get("/v1/jobs") == []
        again = register(daemon.api, "half-started", world_size=2, secret="next-incarnation",
                         timeout_s=5)
        assert again.job_id != first.job_id


def test_a_rank_that_left_is_named_so_to_the_rank_still_waiting_for_it() -> None:
    """Uneven inputs: rank 1 makes one allreduce fewer, then leaves. Rank 0's extra allreduce
    once failed with "silent ...: its worker died", sending its user after a crash that never
    happened; it now says rank 1 left, and why that stalls it."""
    with local_daemon(_config()) as daemon:
        info = register(daemon.api, "uneven", world_size=2, secret="secret-of-the-test")
        with ApplianceClient([info], 0, local_address="127.0.0.1") as waits, \
                ApplianceClient([info], 1, local_address="127.0.0.1") as leaves:
            grads = [np.ones(2000, np.float32), np.ones(2000, np.float32)]
            other = threading.Thread(target=leaves.allreduce, args=(grads[1],))
            other.start()
            waits.allreduce(grads[0])
            other.join(30)
            assert not other.is_alive() and all(np.all(g == 2.0) for g in grads)
            leaves.close()
            leave(leaves.jobs[0], 1)
            with pytest.raises(RankLeft) as stalled:
                waits.allreduce(grads[0])
            text = str(stalled.value)
            assert text.startswith("rank 1 (127.0.0.1:"), text
            assert f"left job {info.job_id}" in text and "different numbers of allreduce" in text
            shown = render_status(UnixApi(daemon.unix_socket).get("/v1/status"))
            assert "! rank 1 (127.0.0.1:" in shown and " left " in shown, shown


def test_a_rank_stopped_mid_job_is_named_to_its_waiting_peer_at_once() -> None:
    """A torchrun run stopped by Ctrl-C: rank 1 leaves while rank 0's allreduce waits for it.
    Rank 0 once learned it only when rank 1 had been silent for the liveness timeout, and its
    own shutdown (which finishes submitted rounds) waited that out: 5 s by default, 60 here.
    The appliance now names a departed rank at once to a peer whose round waits for it; with
    the timeout out of reach, the old code ends this allreduce at its 15 s deadline instead."""
    config = _config()
    config["jobs"]["liveness_timeout_s"] = 60.0
    with local_daemon(config) as daemon:
        info = register(daemon.api, "stopped", world_size=2, secret="secret-of-the-test")
        with ApplianceClient([info], 0, local_address="127.0.0.1",
                             timing=Timing(deadline=15.0)) as waits, \
                ApplianceClient([info], 1, local_address="127.0.0.1") as stopped:
            stopped.close()
            leave(stopped.jobs[0], 1)
            with pytest.raises(RankLeft) as stalled:
                waits.allreduce(np.ones(2000, np.float32))
            text = str(stalled.value)
            assert text.startswith("rank 1 (127.0.0.1:") and "stopped (an exception, Ctrl-C)" \
                in text, text


@needs_raw_icmp
def test_a_rank_whose_process_ended_without_leaving_is_named_ended_within_a_second_or_so(
        ) -> None:
    """Rank 1's process is killed (its socket closes, it leaves nothing): the core reaches it
    once its heartbeats are overdue, loopback answers ICMP port unreachable, and rank 0's
    allreduce fails with RankEnded, not RankSilent a liveness timeout (5 s) later. Its status
    says the same."""
    config = _config()
    config["jobs"]["liveness_timeout_s"] = 5.0
    with local_daemon(config) as daemon:
        info = register(daemon.api, "killed", world_size=2, secret="secret-of-the-test")
        with ApplianceClient([info], 0, local_address="127.0.0.1",
                             timing=Timing(deadline=15.0)) as waits, \
                ApplianceClient([info], 1, local_address="127.0.0.1") as killed:
            killed.close()  # as the kernel closes a killed process's socket: no leave
            with pytest.raises(RankEnded) as stalled:
                waits.allreduce(np.ones(2000, np.float32))
            text = str(stalled.value)
            assert text.startswith("rank 1 (127.0.0.1:") and "ended without leaving" in text \
                and "nothing listens at its endpoint" in text, text
            status = UnixApi(daemon.unix_socket).get("/v1/status")
            (job,) = status["jobs"]
            assert job["ended"] == [1], job
            assert "ended: its host says nothing listens there" in render_status(status)


def test_a_client_whose_block_ends_in_an_exception_leaves_so_its_peer_hears_at_once() -> None:
    """A script that fails (its data loader raised, Ctrl-C) between allreduces, inside its
    `with ApplianceClient(...)` block: the client leaves the job it joined on its way out, so
    the peer's next allreduce fails with RankLeft at once. It once waited for the liveness
    timeout (here out of reach: 60 s) and its own deadline ended it. A block that ends in the
    job's own failure leaves nothing: the peers meet it too, and the status keeps its story."""
    config = _config()
    config["jobs"]["liveness_timeout_s"] = 60.0
    with local_daemon(config) as daemon:
        info = register(daemon.api, "crashed", world_size=2, secret="secret-of-the-test")
        api = UnixApi(daemon.unix_socket)
        with pytest.raises(RankLeft) as stalled, \
                ApplianceClient([info], 0, local_address="127.0.0.1",
                                timing=Timing(deadline=15.0)) as waits:
            with pytest.raises(RuntimeError, match="data loader"), \
                    ApplianceClient([info], 1, local_address="127.0.0.1"):
                raise RuntimeError("the data loader failed")
            waits.allreduce(np.ones(2000, np.float32))
        assert "stopped (an exception, Ctrl-C)" in str(stalled.value), stalled.value
        assert api.get(f"/v1/jobs/{info.job_id}")["joined"] == [0]  # (RankLeft is the job's)
        # A client given the job joined leaves it to whoever joined it.
        with pytest.raises(RuntimeError, match="another"), \
                ApplianceClient([waits.jobs[0]], 0, local_address="127.0.0.1", lease=False,
                                probe_path=False):
            raise RuntimeError("another failure")
        assert api.get(f"/v1/jobs/{info.job_id}")["joined"] == [0]


def test_a_rank_that_splits_the_slots_otherwise_is_refused_at_its_join() -> None:
    """REDUCTION_LANES differing between hosts: each round once waited in other slots for its
    peer until the deadline, and the timeout named a live rank as missing."""
    with local_daemon(_config()) as daemon:
        info = register(daemon.api, "lanes", world_size=2, secret="secret-of-the-test")
        refusal = (r"409 .*rank 1 of job \d+ splits its slots into 1 lane\(s\), the joined "
                   r"rank\(s\) \[0\] into 2")
        with ApplianceClient([info], 0, local_address="127.0.0.1", lanes=2), \
                pytest.raises(RendezvousError, match=refusal):
            ApplianceClient([info], 1, local_address="127.0.0.1", lanes=1)


def test_a_small_receive_buffer_holds_the_windows_and_the_operator_sees_it() -> None:
    """A worker that is not root gets the receive buffer net.core.rmem_max allows: its
    windows are held to what the buffer takes (plugin/hostchecks.py), it still reduces
    exactly, and it says so as it joins, so the appliance's status names it. A window the
    appliance would not believe is refused at the join."""
    with local_daemon(_config()) as daemon:
        info = register(daemon.api, "held", world_size=1, secret="secret-of-the-test")
        udp = UdpWorkerTransport("127.0.0.1")
        udp.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        with ApplianceClient([info], 0, transport=udp) as client:
            slots = client.endpoints[0].slots
            assert client.window_cap is not None and client.window_cap < slots
            assert client.pipeline.window is not None
            assert client.pipeline.window.limit == [client.window_cap]
            data = np.arange(300_000, dtype=np.float32)
            assert np.array_equal(client.allreduce(data.copy()), data)
            (job,) = UnixApi(daemon.unix_socket).get("/v1/status")["jobs"]
            assert job["windows_held"] == {"0": client.window_cap}
            assert (f"! rank 0 holds its windows to {client.window_cap} of {slots} slots a core"
                    in render_status(UnixApi(daemon.unix_socket).get("/v1/status")))
        other = register(daemon.api, "told", world_size=1, secret="secret-of-the-test")
        with pytest.raises(RendezvousError, match="400 .*window_cap must be an integer in "
                                                  r"1\.\.65536, got 0"):
            rendezvous.join(other, 0, ("127.0.0.1", 40000), window_cap=0)


def test_a_second_thread_driving_a_client_is_refused_naming_both() -> None:
    """Two threads calling allreduce on one client once hung each other's rounds (54 of 400
    calls had not returned after 60 s); the second is now refused at once, naming the thread
    that drives the client. A closed client says it is closed."""
    with local_daemon(_config()) as daemon:
        info = register(daemon.api, "threads", world_size=2, secret="secret-of-the-test")
        client = ApplianceClient([info], 0, local_address="127.0.0.1",
                                 timing=Timing(deadline=3.0))
        driver, outcome = _waiting_allreduce(client)  # it waits out its deadline
        with pytest.raises(ReductionError, match=r"ApplianceClient\.start\(\) called from thread "
                                                 r"'MainThread' while thread 'the-driver' "
                                                 r"drives this client"):
            client.start(np.ones(100, np.float32))
        driver.join(30)
        assert not driver.is_alive() and isinstance(outcome[0], AllreduceTimeout)
        client.close()
        # Used once closed: it once raised a bare "OSError: [Errno 9] Bad file descriptor".
        with pytest.raises(ReductionError, match=r"ApplianceClient\.start\(\) on a closed "
                                                 r"client: open another"):
            client.allreduce(np.ones(100, np.float32))


def test_a_client_closed_by_another_thread_ends_the_waiting_allreduce_saying_so() -> None:
    """A watchdog thread closing a client whose allreduce waits (rank 1 never comes): the
    waiting call once raised "OSError: [Errno 9] Bad file descriptor" from its select()."""
    with local_daemon(_config()) as daemon:
        info = register(daemon.api, "watchdog", world_size=2, secret="secret-of-the-test")
        client = ApplianceClient([info], 0, local_address="127.0.0.1",
                                 timing=Timing(deadline=60.0))
        driver, outcome = _waiting_allreduce(client)
        client.close()
        driver.join(30)
        assert not driver.is_alive() and len(outcome) == 1
        assert type(outcome[0]) is ReductionError, repr(outcome[0])
        assert str(outcome[0]) == ("the appliance client was closed during the allreduce (by "
                                   "thread 'MainThread')")


def _waiting_allreduce(client: ApplianceClient) -> tuple[threading.Thread, list[Exception]]:
    """A thread "the-driver" inside an allreduce of `client` that waits (rank 1 never comes),
    and the list its exception lands in."""
    outcome: list[Exception] = []

    def drive() -> None:
        try:
            client.allreduce(np.ones(100, np.float32))
        except Exception as exc:
            outcome.append(exc)

    driver = threading.Thread(target=drive, name="the-driver")
    driver.start()
    wait_until(lambda: client._driver == "the-driver", 10, what="the driver inside wait")
    return driver, outcome


def test_a_rank_that_comes_after_its_peers_aborted_the_job_is_told_why_at_once() -> None:
    """Rank 2 found the job cannot go on and aborted it; rank 1 started late and registered the
    name after that. It once made a fresh job and waited there for its peers, which had gone,
    until its deadline (a CI run's netns test waited out 60 s). Now its join is refused with
    the abort's reason, and the job it made goes with it; a restart of the run (its ranks
    again, with the same name and secret) goes on."""
    why = "its path to the appliance is too narrow (the test says so)"
    secret = "secret-of-the-test"
    with local_daemon(_config()) as daemon:
        api = UnixApi(daemon.unix_socket)
        first = register(daemon.api, "aborted", world_size=3, secret=secret)
        with ApplianceClient([first], 0, local_address="127.0.0.1") as waits:
            rendezvous.abort(waits.jobs[0], 2, why)
            with pytest.raises(JobAborted) as peer:
                waits.allreduce(np.ones(1000, np.float32))
            assert f"(at rank 2's request: {why})" in str(peer.value), peer.value
        started = time.monotonic()
        late = register(daemon.api, "aborted", world_size=3, secret=secret)
        assert late.job_id != first.job_id  # (no job of that name: the registration made one)
        with pytest.raises(JobAborted) as told:
            ApplianceClient([late], 1, local_address="127.0.0.1")
        text = str(told.value)
        assert time.monotonic() - started < 5, text  # not the 60 s deadline
        assert (f"410 rank 1 came after its run had ended: job {first.job_id} ('aborted') was "
                f"aborted (at rank 2's request: {why}) before this rank joined it.") in text, text
        assert api.get("/v1/jobs") == []  # the job it made went with it
        # The operator sees it: counted in status (and metrics), and why in the log.
        status = api.get("/v1/status")
        assert (status["jobs_aborted"], status["late_ranks_refused"]) == (
            {"operator": 0, "rank": 1}, 1)
        assert ("jobs aborted since start: 1 by one of their ranks; 1 late rank(s) told so at "
                "join (the log says why)") in render_status(status)
        for line in (f"aborted job {first.job_id} (aborted): at rank 2's request: {why}",
                     f"refused rank 1's join of job {late.job_id}: rank 1 came after its run",
                     f"withdrew job {late.job_id} (aborted): a late rank of an aborted run "
                     "registered it"):
            wait_until(lambda line=line: line in daemon.stderr.text(), 5, what=line)
        # The run restarted: a rank of the aborted job joins first, and the job goes on.
        again = register(daemon.api, "aborted", world_size=3, secret=secret)
        grads = [np.full(1000, float(r + 1), np.float32) for r in range(3)]
        with ApplianceClient([again], 0, local_address="127.0.0.1") as r0, \
                ApplianceClient([again], 1, local_address="127.0.0.1") as r1, \
                ApplianceClient([again], 2, local_address="127.0.0.1") as r2:
            others = [threading.Thread(target=c.allreduce, args=(g,))
                      for c, g in zip((r1, r2), grads[1:], strict=True)]
            for t in others:
                t.start()
            r0.allreduce(grads[0])
            for t in others:
                t.join(30)
            assert all(np.all(g == 6.0) for g in grads)
