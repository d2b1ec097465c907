"""Several ranks per host on the emulated rack (a server with several GPUs and one NIC): the
"reduction" backend reduces on each host first and its leader talks to the appliance
(plugin.torch_hosts). Two hosts of two ranks, a real reductiond, results against Gloo; and
what the ranks hear when the appliance aborts the job or a rank dies."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: the PyTorch plugin needs it", allow_module_level=True)

from reduction_appliance.deploy.testnet.harness import ApplianceProcess, LabNetwork, start_appliance
from tests.plugin.ranks import BACKEND_CHECKS, launch_ranks, run_ranks
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each

WORLD, PER_HOST = 4, 2
Rack = tuple[LabNetwork, ApplianceProcess]


@pytest.fixture(scope="module")
def rack() -> Iterator[Rack]:
    with LabNetwork.rack(WORLD, ranks_per_host=PER_HOST) as net, \
            start_appliance(net, cores=2) as appliance:
        yield net, appliance


@pytest.fixture
def env(rack: Rack, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("REDUCTION_APPLIANCE", rack[1].api)
    for name in ("REDUCTION_JOB", "REDUCTION_DETERMINISTIC", "REDUCTION_LANES",
                 "REDUCTION_HIERARCHY", "STALLED_RANKS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _finish(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[list[dict[str, Any]]]:
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            assert proc.returncode in (0, -9), err[-2000:]
            results.append([json.loads(line) for line in out.splitlines() if line[:1] == "{"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def test_every_dtype_and_op_matches_gloo_with_two_ranks_per_host(
        rack: Rack, env: pytest.MonkeyPatch) -> None:
    outputs = run_ranks(rack[0], "backend", WORLD)
    for rank, records in enumerate(outputs):
        seen = {(r["check"], r.get("dtype"), r.get("op")) for r in records}
        assert seen == BACKEND_CHECKS, f"rank {rank}: {seen ^ BACKEND_CHECKS}"
        failed = [r for r in records if not r["ok"]]
        assert not failed, f"rank {rank}: {failed}"
        (layout,) = [r for r in records if r["check"] == "layout"]
        assert layout["staged"] and layout["hosts"] == [[0, 1], [2, 3]], (rank, layout)


def test_the_ddp_hook_reduces_on_the_host_first_and_trains_as_gloo(
        rack: Rack, env: pytest.MonkeyPatch) -> None:
    outputs = run_ranks(rack[0], "ddp", WORLD)
    for rank, records in enumerate(outputs):
        assert {r["check"] for r in records} == {"ddp-identical", "ddp-vs-gloo"}, rank
        assert all(r["ok"] for r in records), f"rank {rank}: {records}"
        trained = next(r for r in records if r["check"] == "ddp-vs-gloo")
        assert trained["staged"] == [True], (rank, trained)


def test_flat_by_request_and_when_deterministic(rack: Rack, env: pytest.MonkeyPatch) -> None:
    """REDUCTION_HIERARCHY=flat, and a deterministic job (its promise is the appliance's sum
    in rank order, bit for bit), keep every rank on the appliance."""
    env.setenv("REDUCTION_HIERARCHY", "flat")
    outputs = run_ranks(rack[0], "backend", WORLD)
    assert all(r["ok"] for out in outputs for r in out), outputs
    assert all(not r["staged"] for out in outputs for r in out if r["check"] == "layout")
    env.delenv("REDUCTION_HIERARCHY")
    env.setenv("REDUCTION_DETERMINISTIC", "1")
    outputs = run_ranks(rack[0], "backend", WORLD)
    assert all(r["ok"] for out in outputs for r in out), outputs
    assert all(not r["staged"] for out in outputs for r in out if r["check"] == "layout")


def test_an_abort_reaches_every_rank_of_the_host_with_the_appliances_reason(
        rack: Rack, env: pytest.MonkeyPatch) -> None:
    """Host 1's ranks never call all_reduce; host 0's leader waits for its share at the
    appliance, its other rank for the leader. The operator's abort reaches both, with the
    appliance's words, the leader's as its own and the other rank's through the leader."""
    net, appliance = rack
    env.setenv("REDUCTION_JOB", "hosts-doomed")
    env.setenv("STALLED_RANKS", str(PER_HOST))
    procs = launch_ranks(net, "stall", WORLD)
    try:
        def lagging() -> bool:
            job = {j["name"]: j for j in appliance.status()["jobs"]}.get("hosts-doomed")
            # The job's ranks are the hosts: its world is 2, and host 1 lags.
            return bool(job and job["state"] == "active" and job["world_size"] == 2
                        and "1" in job["lagging"])

        wait_until(lagging, 60, what="both hosts' leaders joined and host 1 reported lagging")
        (job_id,) = appliance.job_ids("hosts-doomed")
        appliance.local_api.request("POST", f"/v1/jobs/{job_id}/abort")
    except BaseException:
        _finish(procs, 0.1)
        raise
    results = _finish(procs, 30)  # well inside the 60 s allreduce deadline
    words = f"aborted job {job_id} (an operator's abort"
    (leader,), (other,) = results[0], results[1]
    assert leader["raised"] == "JobAborted" and words in leader["message"], leader
    assert other["raised"] == "ReductionError", other
    assert other["message"].startswith("rank 0 reduces this host's sum through the appliance, "
                                       "and there it failed: ") and words in other["message"]
    assert leader["seconds"] < 30 and other["seconds"] < 30
    assert results[2:] == [[], []]


def test_a_killed_rank_fails_every_other_rank_at_once(rack: Rack,
                                                       env: pytest.MonkeyPatch) -> None:
    """Rank 3 (host 1's second) dies mid-run. Host 1's leader hears it from Gloo and leaves
    the appliance's job, so host 0 is told at once too: no rank waits out its deadline
    (60 s here) for a share that can never come."""
    net = rack[0]
    env.setenv("REDUCTION_JOB", "hosts-killed")
    procs = launch_ranks(net, "loop", WORLD)
    try:
        assert procs[3].stdout is not None
        first = procs[3].stdout.readline()  # blocks until rank 3's first all_reduce is done
        assert json.loads(first)["check"] == "looping", first
        procs[3].kill()
    except BaseException:
        _finish(procs, 0.1)
        raise
    results = _finish(procs, 45)
    for rank in range(3):
        (outcome,) = [r for r in results[rank] if r["check"] == "loop"]
        assert outcome["raised"] in ("ReductionError", "RankLeft"), (rank, outcome)
        assert outcome["seconds"] < 30, (rank, outcome)
    host1 = next(r for r in results[2] if r["check"] == "loop")
    assert "this host's group of ranks failed" in host1["message"], host1
    host0 = next(r for r in results[0] if r["check"] == "loop")
    assert "rank 1 (" in host0["message"] and "left" in host0["message"], host0
    # The appliance's rank 1 is host 1, whose ranks the message names.
    assert "the appliance's ranks are this group's hosts: rank 0 is ranks 0,1; rank 1 is " \
        "ranks 2,3" in host0["message"], host0
