"""The control plane with the real reductiond and real workers on an emulated rack, asserted
through the product's own interfaces: reductionctl, the API, /metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from reduction_appliance.control.apiclient import ApiError
from reduction_appliance.deploy.testnet.harness import (
    HarnessError,
    LabNetwork,
    api_request,
    run_workers,
    start_appliance,
    worker_argv,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each


ROOT = Path(__file__).resolve().parents[2]


def launch(net: LabNetwork, hosts: list[int], argv: list[list[str]]) -> list[subprocess.Popen[str]]:
    return [net.popen_worker(h, [sys.executable, *a], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for h, a in zip(hosts, argv,
                                                                             strict=True)]


def finish(procs: list[subprocess.Popen[str]], timeout_s: float = 180) -> list[tuple[int, list[
        dict[str, Any]], str]]:
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        out.append((proc.returncode, rows, stderr))
    return out


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reduction_appliance.control.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_two_jobs_at_once_are_exact_and_a_third_is_refused_for_budget() -> None:
    with LabNetwork.rack(4) as net, start_appliance(net) as appliance:
        big = worker_argv(net, appliance.api, 4, "fp32-job",
                          ["--sizes", "4MiB", "--dtypes", "fp32", "--iters", "3"])
        small = [a for a in worker_argv(net, appliance.api, 2, "bf16-job",
                                        ["--sizes", "1MiB", "--dtypes", "bf16",
                                         "--ops", "sum,max", "--iters", "3"])]
        # Both jobs share hosts w0 and w1 and both appliance cores, at the same time.
        procs = launch(net, [0, 1, 2, 3], big) + launch(net, [0, 1], small)
        results = finish(procs)
        for code, rows, stderr in results:
            assert code == 0, stderr
            assert rows and all(r["ok"] and r["checked"] for r in rows)
        with pytest.raises(ApiError) as refused:
            appliance.local_api.request("POST", "/v1/jobs", {
                "name": "too-big", "world_size": 2, "slots": 100000})
        assert refused.value.status == 409  # does not fit: AdmissionError
        assert "slot" in str(refused.value) and "free" in str(refused.value)
        status = appliance.status()
        assert {j["name"] for j in status["jobs"]} == {"fp32-job", "bf16-job"}


def test_tcp_api_requires_the_token() -> None:
    token = "s3cret-token-0123456789abcdef"
    with LabNetwork.rack(2) as net, start_appliance(net, token=token) as appliance:
        with pytest.raises(HarnessError, match="401"):
            api_request(net, 0, "GET", f"http://{appliance.api}/v1/status")
        token_file = str(appliance.config_path.parent / "token")
        outputs = run_workers(net, worker_argv(net, appliance.api, 2, "with-token",
                                               ["--sizes", "64KiB", "--iters", "1",
                                                "--token-file", token_file]))
        assert all(c["ok"] for o in outputs for c in o)
        bad = Path(appliance.config_path.parent / "wrong")
        bad.write_text("not-the-token-at-all-xxxxxxxx")
        with pytest.raises(HarnessError, match="401"):
            run_workers(net, worker_argv(net, appliance.api, 2, "bad-token",
                                         ["--sizes", "64KiB", "--token-file", str(bad)]))


def test_killed_core_is_restarted_and_the_allreduce_finishes_or_fails_clearly() -> None:
    # Workers send their heartbeats to core 0: while it restarts, the appliance is silent to
    # them. A restart takes well under a second on a quiet machine, but once over 5 s (the
    # default liveness timeout) on a loaded CI host, and the workers rightly called the appliance
    # dead; this test is about the restart, so it gives the restart room (the liveness bound has
    # tests of its own: tests/netns/test_liveness.py).
    with LabNetwork.rack(2) as net, start_appliance(net, liveness_s=30.0) as appliance:
        procs = launch(net, [0, 1], worker_argv(
            net, appliance.api, 2, "survivor",
            ["--sizes", "64MiB", "--iters", "4", "--deadline", "60", "--no-check"]))
        wait_until(lambda: appliance.counters().get("bytes_reduced", 0) > 0, 60,
                   what="traffic through the appliance")
        victim = appliance.status()["cores"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        core = wait_until(lambda: next(
            (c for c in appliance.status()["cores"] if c["index"] == 0 and c["restarts"] == 1
             and c["state"] == "running"), None), 60, what="core 0 restarted")
        assert core["pid"] != victim
        (job,) = appliance.status()["jobs"]
        assert any("core 0 killed by signal 9" in d for d in job["disruptions"]), job
        # The restarted core came back empty: the job moves to a new epoch.
        wait_until(lambda: appliance.status()["jobs"][0]["epoch"] == 2, 30, what="epoch 2")
        for code, _rows, stderr in finish(procs, timeout_s=120):
            # Either the round carried over into the new epoch, or the worker got a clear
            # error naming the core restart (it had results already): never a hang.
            assert code == 0 or ("JobResynchronised" in stderr and "core" in stderr), stderr


def test_status_and_metrics_show_jobs_counters_and_a_stalled_rank() -> None:
    with LabNetwork.rack(3) as net, start_appliance(net) as appliance:
        run_workers(net, worker_argv(net, appliance.api, 2, "healthy",
                                     ["--sizes", "1MiB", "--iters", "2"]))
        # A job of three ranks where rank 2 never comes: ranks 0 and 1 wait on it.
        stalled = launch(net, [0, 1], worker_argv(net, appliance.api, 3, "stalled",
                                                  ["--sizes", "64KiB", "--deadline", "60"])[:2])
        try:
            def lagging() -> dict[str, Any] | None:
                done = ctl("status", "--json", "--socket", appliance.unix_socket)
                assert done.returncode == 0, done.stderr
                jobs = {j["name"]: j for j in json.loads(done.stdout)["jobs"]}
                job = jobs.get("stalled")
                # Exactly rank 2: until rank 1's first contribution is in (its process may
                # start a second after rank 0's), the core waits on rank 1 as well.
                return jobs if job and set(job["lagging"]) == {"2"} else None

            jobs = wait_until(lagging, 30, what="rank 2 alone reported lagging")
            assert jobs["healthy"]["rounds"] >= 3 and jobs["healthy"]["bytes_reduced"] > 0
            human = ctl("status", "--socket", appliance.unix_socket)
            assert "stalled" in human.stdout and "2 (" in human.stdout
            text = appliance.local_api.get("/metrics")
            families = {f.name: f for f in text_string_to_metric_families(text)}
            lag = [s for s in families["reduction_job_lagging_rank_seconds"].samples
                   if s.labels["name"] == "stalled"]
            assert [s.labels["rank"] for s in lag] == ["2"] and lag[0].value > 0
            received = families["reduction_core_packets_received"].samples
            assert sum(s.value for s in received) > 0
        finally:
            for proc in stalled:
                proc.kill()
                proc.communicate()


@pytest.mark.parametrize("how", ["reductionctl abort", "SIGTERM"])
def test_an_aborted_jobs_workers_are_told_at_once_and_why(how: str) -> None:
    """Two ranks wait for a third; the operator aborts the job, or the appliance is stopped:
    both fail with JobAborted naming the job and the reason, well inside their deadline."""
    with LabNetwork.rack(3) as net, start_appliance(net) as appliance:
        stalled = launch(net, [0, 1], worker_argv(net, appliance.api, 3, "doomed",
                                                  ["--sizes", "64KiB", "--deadline", "60"])[:2])
        # both launched ranks joined (a rank joining after the abort would wait out its own
        # deadline, not be told) and their first round begun, waiting for rank 2
        wait_until(lambda: [(j["joined"], list(j["lagging"])) for j in
                            appliance.status()["jobs"] if j["name"] == "doomed"]
                   == [([0, 1], ["2"])], 30,
                   what="ranks 0 and 1 joined and their round waiting for rank 2")
        (job_id,) = appliance.job_ids("doomed")
        if how == "SIGTERM":
            appliance.process.send_signal(signal.SIGTERM)
            # the round begun cannot finish without rank 2, which never joined: told at once
            why = (r"the appliance is shutting down: the rounds up to \d+ wait for rank\(s\) "
                   r"\[2\], which never joined, left, or ended \(its process gone\), so none could "
                   "finish")
        else:
            done = ctl("abort", str(job_id), "--socket", appliance.unix_socket)
            assert done.returncode == 0, done.stderr
            why = re.escape(f"an operator's abort: reductionctl abort {job_id} or DELETE "
                            f"/v1/jobs/{job_id}")
        for code, _, stderr in finish(stalled, timeout_s=30):
            assert code == 3 and "JobAborted" in stderr, stderr[-2000:]
            assert re.search(rf"aborted job {job_id} \({why}\) during", stderr), stderr[-2000:]
            # nothing of the round reached the tensor: no rank summed it with the others
            assert "the appliance wrote nothing into the array it was given" in stderr, \
                stderr[-2000:]


def _route(net: LabNetwork, prefix: str) -> str:
    return net.lab.run("a0", ["ip", "route", "show", prefix]).stdout.strip()


def test_steering_lives_with_the_daemon_and_clean_removes_leftovers() -> None:
    groups = "239.255.128.0/17"  # narrower than the lab's own route: ours to add and remove
    with LabNetwork.rack(2) as net:
        ifname = net.lab.interface_of("a0")
        with start_appliance(net, interface=ifname, groups=groups) as appliance:
            assert ifname in _route(net, groups)
            outputs = run_workers(net, worker_argv(net, appliance.api, 2, "steered",
                                                   ["--sizes", "1MiB", "--iters", "1"]))
            assert all(c["ok"] for o in outputs for c in o)
            shown = ctl("steering", "--json", "--socket", appliance.unix_socket)
            assert groups in shown.stdout
        assert _route(net, groups) == ""  # SIGTERM removed it
        with start_appliance(net, interface=ifname, groups=groups) as appliance:
            config = str(appliance.config_path)
            os.killpg(appliance.process.pid, signal.SIGKILL)  # a crash: nothing cleans up
            appliance.process.wait()
            assert ifname in _route(net, groups)
            done = net.lab.run("a0", [sys.executable, "-m", "reduction_appliance.control.cli",
                                      "clean", "--config", config])
            assert "removed" in done.stdout
            assert _route(net, groups) == ""
            assert not Path(appliance.unix_socket).exists()
