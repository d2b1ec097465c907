"""A real reductiond with RoCE (its core on rxe1) and worker processes on rxe2..rxe4: jobs
created over the API with transport roce, queue pairs connected through it, results exact,
status showing the queue pairs, a dead rank or a stopped appliance a clear error."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reduction_appliance.control.apiclient import UnixApi
from reduction_appliance.dataplane.verbs import SEND_BYTES
from reduction_appliance.plugin.rendezvous import JobInfo, RendezvousError, connect, register
from tests.roce.daemon import SEGMENT, START_S, Appliance, appliance
from tests.roce.loss import multicast_loss
from tests.roce.ranks import Rank
from tests.roce.worker import DTYPES, inputs, reference
from tests.waiting import wait_until

CTL = [sys.executable, "-m", "reduction_appliance.control.cli"]


def workers(app: Appliance, out: Path, world: int, *, name: str, elements: int,
            dtype: str = "fp32", op: str = "sum", rounds: int = 1, deterministic: bool = False,
            exit_after_join: tuple[int, ...] = (), stay: bool = False, multicast: bool = False,
            hold: bool = False) -> list[Rank]:
    """`world` rank processes on rxe2..rxe4 (10.77.0.2..4). `hold`: each rank waits, joined
    and heartbeating, until its stdin closes (`finish` closes it): after its join if it exits
    after the join, else after its rounds."""
    procs = []
    for rank in range(world):
        argv = ["--api", app.api, "--name", name, "--secret", "s3cret-" + name,
                "--rank", str(rank), "--world", str(world), "--ip", f"10.77.0.{2 + rank % 3}",
                "--elements", str(elements), "--dtype", dtype, "--op", op, "--rounds",
                str(rounds), "--out", str(out)]
        argv += ["--deterministic"] * deterministic + ["--exit-after-join"] * (
            rank in exit_after_join) + ["--stay"] * stay + ["--multicast"] * multicast
        argv += ["--hold"] * hold
        procs.append(Rank(argv, out / f"stderr-{name}-{rank}.txt", hold))
    return procs


def finish(procs: list[Rank], timeout: float = START_S) -> list[tuple[int, str]]:
    done = []
    for p in procs:
        try:
            code, err = p.wait(timeout)
            done.append((code, err[-2000:]))
        except subprocess.TimeoutExpired:
            p.kill()
            done.append((-1, "timed out: " + p.wait()[1][-2000:]))
    return done


def status(app: Appliance) -> dict[str, Any]:
    """What `reductionctl status --json` prints, asked through the same client in this process:
    a reductionctl process takes 6 s to start in the guest (the deterministic test runs one)."""
    answer: dict[str, Any] = UnixApi(app.unix_socket, timeout_s=120).get("/v1/status")
    return answer


@pytest.fixture
def app(roce_appliance: Appliance) -> Appliance:
    return roce_appliance


@pytest.mark.parametrize(("dtype", "op"), [("fp32", "sum"), ("fp16", "avg"), ("bf16", "max"),
                                           ("fp32", "min")])
def test_worker_processes_reduce_exactly_over_roce(app: Appliance, tmp_path: Path, dtype: str,
                                                   op: str) -> None:
    world, elements = 3, 70_001  # several 64 KiB segments and a short tail
    procs = workers(app, tmp_path, world, name=f"exact-{dtype}-{op}", elements=elements,
                    dtype=dtype, op=op, rounds=2)
    assert all(rc == 0 for rc, _ in finish(procs)), finish(procs)
    for r in range(2):
        want = reference([inputs(k, elements, dtype, False, r) for k in range(world)], op)
        for rank in range(world):
            got = np.load(tmp_path / f"result-{rank}-{r}.npy").view(DTYPES[dtype])
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (rank, r)


def core_counters(app: Appliance) -> dict[str, int]:
    counters: dict[str, int] = status(app)["cores"][0]["counters"]
    return counters


@pytest.mark.parametrize("lossy", [False, True], ids=["lossless", "every-20th-chunk-lost"])
def test_multicast_results_are_exact_and_lost_chunks_repaired(
        app: Appliance, tmp_path: Path, lossy: bool) -> None:
    """UD multicast mode: each result leaves the core once; on a lossy network a worker that
    misses a chunk asks again and gets the whole result written to it."""
    # An odd size whose last segment (36166 bytes) is still larger than a SEND: then every
    # repaired result is a write, whichever chunk is lost (a result that fits in a SEND, such
    # as a 3.4 KB tail, is repaired by a SEND and would not count as a write).
    world, elements, dtype = 3, 116_387, "fp16"
    name = f"multicast-{'lossy' if lossy else 'clean'}"
    before = core_counters(app)
    with multicast_loss(every=20) if lossy else contextlib.nullcontext():
        procs = workers(app, tmp_path, world, name=name, elements=elements, dtype=dtype,
                        rounds=2, multicast=True)
        assert all(rc == 0 for rc, _ in finish(procs)), finish(procs)
    for r in range(2):
        want = reference([inputs(k, elements, dtype, False, r) for k in range(world)], "sum")
        for rank in range(world):
            got = np.load(tmp_path / f"result-{rank}-{r}.npy").view(DTYPES[dtype])
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (rank, r)
    after = core_counters(app)
    moved = {k: after[k] - before[k] for k in after}
    size = elements * 2
    lengths = [min(SEGMENT, size - at) for at in range(0, size, SEGMENT)]
    assert all(48 + n > SEND_BYTES for n in lengths)  # every repair is a write (see above)
    assert moved["segments_reduced"] == 2 * len(lengths)
    # Each result left once (chunks of the 4096-byte MTU, header in the first), not per rank.
    assert moved["roce_multicast_chunks"] == 2 * sum(-(-(48 + n) // 4096) for n in lengths)
    # Whatever a rank missed was asked again and written whole to it: no result is written
    # but a repair. Without injected loss a repair is still possible: UD may drop a chunk (rxe
    # drops one that finds no receive posted), and a rank the emulated CPU left behind may see
    # its retransmission timer fire first (one CI run on a loaded host had one repair). Yet
    # multicast must have carried most of the 2 x 4 results to each rank.
    assert moved["roce_result_writes"] == moved["results_resent"], moved
    if lossy:
        assert moved["results_resent"] > 0, moved
    else:
        assert moved["results_resent"] < world * 2 * len(lengths) // 4, moved


def test_sixteen_mebibytes_and_four_kibibytes_as_two_jobs_at_once(
        app: Appliance, tmp_path: Path) -> None:
    """The sizes' two ends, as two jobs whose ranks run at the same time on the same core."""
    jobs = {"big": (16 * 2**20 // 4, "fp32", "sum"), "small": (4096 // 2, "bf16", "avg")}
    procs = {}
    for name, (elements, dtype, op) in jobs.items():
        (tmp_path / name).mkdir()
        procs[name] = workers(app, tmp_path / name, 2, name=f"at-once-{name}",
                              elements=elements, dtype=dtype, op=op)
    for name, (elements, dtype, op) in jobs.items():
        results = finish(procs[name])
        assert all(rc == 0 for rc, _ in results), results
        want = reference([inputs(k, elements, dtype, False, 0) for k in range(2)], op)
        for rank in range(2):
            got = np.load(tmp_path / name / f"result-{rank}-0.npy")
            assert np.array_equal(got, want.view(np.uint8)), (name, rank)


def test_deterministic_mode_is_bitwise_and_status_shows_the_queue_pairs(
        app: Appliance, tmp_path: Path) -> None:
    world, elements = 3, 40_000
    procs = workers(app, tmp_path, world, name="det", elements=elements, deterministic=True)
    results = finish(procs)
    assert all(rc == 0 for rc, _ in results), results
    want = reference([inputs(k, elements, "fp32", True, 0) for k in range(world)], "sum")
    for rank in range(world):
        got = np.load(tmp_path / f"result-{rank}-0.npy").view(np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # Every job so far is done (its ranks left): their queue pairs went with them. A job whose
    # ranks joined and stay shows its two, connected while the ranks live. (Read after they
    # exited, a slow guest could pass the 5 s liveness timeout first: the appliance then tells
    # the gone ranks, and a send to a gone peer puts its queue pair in ERR.)
    # Their own folder: the first job's ranks left joined-0 and joined-1 in tmp_path.
    shown = tmp_path / "shown"
    shown.mkdir()
    procs = workers(app, shown, 2, name="shown", elements=10, exit_after_join=(0, 1), hold=True)
    try:
        wait_until(lambda: all((shown / f"joined-{r}").exists() for r in (0, 1)), START_S,
                   0.05, "both ranks joined")
        answer = status(app)
        # The operator's table too, while the ranks hold: reductionctl's start-up in a slow guest
        # can take longer than the liveness timeout, after which the job is gone.
        table = subprocess.run([*CTL, "status", "--socket", app.unix_socket],
                               capture_output=True, text=True, timeout=120).stdout
    finally:
        finish(procs)  # (waiting closes each one's stdin: it exits)
    qps = answer["cores"][0]["queue_pairs"]
    assert [j["transport"] for j in answer["jobs"] if j["name"] == "shown"] == ["roce"]
    assert len(qps) == 2, qps
    for q in qps:
        assert q["state"] == "RTS" and q["local"]["device"] == "rxe1", q
        assert q["remote"]["device"] in ("rxe2", "rxe3") and q["remote"]["qpn"] > 0, q
        assert q["local"]["mtu"] == 4096 and q["address"][0] in ("10.77.0.2", "10.77.0.3"), q
    assert "roce: 2 queue pair(s)" in table and table.count("<-> qpn") == 2, table
    assert "[roce]" in table, table


def test_a_rank_that_dies_is_named_to_the_others_within_the_liveness_timeout(
        app: Appliance, tmp_path: Path) -> None:
    world = 3
    procs = workers(app, tmp_path, world, name="dies", elements=10_000, exit_after_join=(2,))
    started = time.monotonic()
    results = finish(procs)
    assert results[2][0] == 0  # it left by exiting after its join
    for rank in (0, 1):
        assert results[rank][0] == 1, results[rank]
        error = (tmp_path / f"error-{rank}").read_text()
        assert "RankSilent" in error and "rank 2" in error, error
    assert time.monotonic() - started < START_S


def test_a_rank_killed_mid_run_is_named_to_the_others(app: Appliance, tmp_path: Path) -> None:
    """Rank 2 SIGKILLed while the ranks are in their rounds of 8 MB (its segments half sent or
    not): ranks 0 and 1 fail with RankSilent naming it, within the liveness timeout."""
    procs = workers(app, tmp_path, 3, name="killed", elements=2_000_000, rounds=30)
    wait_until(lambda: (tmp_path / "result-2-0.npy").exists(), START_S, 0.05, "a round done")
    procs[2].kill()
    killed = time.monotonic()
    results = finish(procs)
    for rank in (0, 1):
        assert results[rank][0] == 1, results[rank]
        error = (tmp_path / f"error-{rank}").read_text()
        assert "RankSilent" in error and "rank 2" in error, error
    # Named within the liveness timeout (5 s), plus the guest's slowness in reporting it.
    assert time.monotonic() - killed < 60.0


def test_an_unknown_job_or_a_udp_job_is_refused_a_connection(app: Appliance) -> None:
    udp = register(app.api, "plain-udp", 2, secret="s3cret-udp", multicast=False)
    with pytest.raises(RendezvousError, match=r"409.*not roce"):
        connect(udp, 0, "10.77.0.2", [{}])
    ghost = JobInfo(app.api, 999, "ghost", 2, SEGMENT, None, False, 60.0, (), secret="x")
    with pytest.raises(RendezvousError, match="404"):
        connect(ghost, 0, "10.77.0.2", [{}])
    roce = register(app.api, "bad-secret", 2, secret="s3cret-right", multicast=False,
                    transport="roce")
    with pytest.raises(RendezvousError, match="403"):
        connect(replace(roce, secret="wrong"), 0, "10.77.0.2", [{}])


def test_a_stopped_appliance_is_an_error_for_its_workers(tmp_path: Path) -> None:
    with appliance(base_port=7100) as own:  # beside the module's appliance
        procs = workers(own, tmp_path, 2, name="stopped", elements=2_000_000, rounds=50)
        wait_until(lambda: (tmp_path / "joined-0").exists() and (tmp_path / "joined-1").exists(),
                   START_S, 0.2, "both ranks joined")
        os.killpg(own.process.pid, signal.SIGKILL)  # the whole appliance, cores included
        results = finish(procs)
    for rank in (0, 1):
        assert results[rank][0] == 1, results[rank]
        error = (tmp_path / f"error-{rank}").read_text()
        # (ApplianceEnded where its API's refusal came first: plugin.silence)
        assert any(said in error for said in ("ApplianceEnded", "ApplianceSilent",
                                              "lost the RoCE connection")), error


def test_a_restarted_core_takes_its_roce_workers_back(tmp_path: Path) -> None:
    """The supervisor restarts a killed core empty: the workers' queue pairs to it break, they
    connect again through the API (same address), and the job goes on in a new epoch: each
    worker finishes or gets the clear JobResynchronised, never "lost the RoCE connection"."""
    # Liveness and deadline above the guest's core restart (tens of seconds when emulated).
    with appliance(base_port=7300, liveness_s=120.0, deadline_s=150.0) as own:
        victim = status(own)["cores"][0]["pid"]
        # Rounds of 8 MB: one to three seconds each in the guest, so the kill, after two, lands
        # with four to go.
        # Held after their rounds: status is read while they live. (A rank gone first leaves
        # the core's queue pair to it in ERR once a send to it finds no peer: one CI run.)
        procs = workers(own, tmp_path, 2, name="restart", elements=2_000_000, rounds=6,
                        stay=True, hold=True)
        wait_until(lambda: (tmp_path / "result-0-1.npy").exists()
                   and (tmp_path / "result-1-1.npy").exists(), START_S, 0.1, "two rounds")
        os.kill(victim, signal.SIGKILL)
        try:
            wait_until(lambda: all((tmp_path / f"result-{r}-5.npy").exists()
                                   or (tmp_path / f"error-{r}").exists() for r in (0, 1)),
                       3 * START_S, 0.1, "the rounds after the restart")
            answer = status(own)
        finally:
            results = finish(procs, timeout=3 * START_S)
        for rank, (code, err) in enumerate(results):
            error = (tmp_path / f"error-{rank}").read_text() if code else ""
            assert code == 0 or "JobResynchronised" in error, (rank, error, err)
            assert "connected again" in err, err
        core = answer["cores"][0]
        assert core["restarts"] == 1 and core["pid"] != victim
        assert answer["jobs"][0]["epoch"] == 2
        assert len(core["queue_pairs"]) == 2 and all(q["state"] == "RTS"
                                                     for q in core["queue_pairs"]), core
