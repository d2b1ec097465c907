"""The PyTorch plugin on the emulated rack: four torch processes, one per worker namespace, a
real reductiond in its own namespace, results checked against Gloo on the same ranks."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: the PyTorch plugin needs it", allow_module_level=True)

from reduction_appliance.deploy.testnet.harness import ApplianceProcess, LabNetwork, start_appliance
from tests.plugin.ranks import BACKEND_CHECKS, launch_ranks, run_ranks
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each


WORLD = 4
Rack = tuple[LabNetwork, ApplianceProcess]


@pytest.fixture(scope="module")
def rack() -> Iterator[Rack]:
    with LabNetwork.rack(WORLD) as net, start_appliance(net, cores=2) as appliance:
        yield net, appliance


@pytest.fixture
def env(rack: Rack, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("REDUCTION_APPLIANCE", rack[1].api)
    for name in ("REDUCTION_JOB", "REDUCTION_DETERMINISTIC", "REDUCTION_LANES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def all_ok(outputs: list[list[dict[str, Any]]], expected: set[tuple[Any, ...]]) -> None:
    for rank, records in enumerate(outputs):
        seen = {(r["check"], r.get("dtype"), r.get("op")) for r in records}
        assert seen == expected, f"rank {rank}: {seen ^ expected}"
        failed = [r for r in records if not r["ok"]]
        assert not failed, f"rank {rank}: {failed}"


def test_every_dtype_and_op_matches_gloo(rack: Rack, env: pytest.MonkeyPatch) -> None:
    outputs = run_ranks(rack[0], "backend", WORLD)
    all_ok(outputs, BACKEND_CHECKS)
    # A rank per host: every rank talks to the appliance itself.
    assert all(not r["staged"] for out in outputs for r in out if r["check"] == "layout")


def test_deterministic_mode_is_bitwise_the_rank_order_reference(
        rack: Rack, env: pytest.MonkeyPatch) -> None:
    env.setenv("REDUCTION_DETERMINISTIC", "1")
    expected = {("deterministic", d, o) for d in ("fp32", "fp16", "bf16")
                for o in ("sum", "avg", "min", "max")} | {("layout", None, None)}
    all_ok(run_ranks(rack[0], "backend", WORLD), expected)


def test_async_buckets_overlap_on_the_wire(rack: Rack, env: pytest.MonkeyPatch) -> None:
    env.setenv("REDUCTION_LANES", "4")
    outputs = run_ranks(rack[0], "overlap", WORLD)
    for rank, (record,) in enumerate(outputs):
        assert record["ok"], f"rank {rank}: wrong results"
        # Eight outstanding all_reduces, four lanes: all four were on the wire together.
        assert record["most_in_flight"] == record["lanes"] == 4, (rank, record)
        # Each tensor is cut into as many rounds as it needs to have every segment on the
        # wire at once, one lane's window each, at most one per lane: a 256 KiB one into 2
        # (30 segments of 8.9 KB, lanes of 8 slots on each of 2 cores), 4 MiB and 2 MiB ones
        # into 4.
        assert (record["segment_bytes"], record["lane_window"]) == (8896, 16), record
        assert record["rounds"] == 8 * 2 + 4 + 4, (rank, record)


def test_an_abort_raises_jobaborted_in_the_training_process(
        rack: Rack, env: pytest.MonkeyPatch) -> None:
    net, appliance = rack
    env.setenv("REDUCTION_JOB", "torch-doomed")
    procs = launch_ranks(net, "stall", WORLD)  # the last rank never calls all_reduce
    try:
        def lagging() -> bool:
            # Every rank joined (ACTIVE; none leaves before the abort: the workers' barrier),
            # and the ranks' segments wait for the last. Lagging alone can show before the last
            # rank has joined (its process starts last), and an abort then refuses its join.
            jobs = {j["name"]: j for j in appliance.status()["jobs"]}
            job = jobs.get("torch-doomed")
            return bool(job and job["state"] == "active" and str(WORLD - 1) in job["lagging"])

        wait_until(lagging, 60, what=f"every rank joined and rank {WORLD - 1} reported lagging")
        (job_id,) = appliance.job_ids("torch-doomed")
        appliance.local_api.request("POST", f"/v1/jobs/{job_id}/abort")
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=30)  # well inside the 60 s allreduce deadline
            assert proc.returncode == 0, err[-2000:]
            results.append([json.loads(line) for line in out.splitlines() if line[:1] == "{"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, records in enumerate(results[:-1]):
        (record,) = records
        assert record["raised"] == "JobAborted", (rank, record)
        assert f"aborted job {job_id} (an operator's abort: reductionctl abort {job_id} or " \
            f"DELETE /v1/jobs/{job_id}) during" in record["message"]
        assert record["seconds"] < 30
    assert results[-1] == []
