"""The PyTorch plugin against a real reductiond on loopback: the "reduction" backend and the DDP
communication hook, each rank a subprocess (see torch_worker.py), compared with Gloo."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: the PyTorch plugin needs it", allow_module_level=True)

import torch

from reduction_appliance.control.config import parse
from reduction_appliance.control.registry import JobRequest, Registry
from reduction_appliance.dataplane.errors import AllreduceTimeout, JobAborted, ReductionError
from reduction_appliance.deploy.testnet.harness import (
    ApplianceProcess,
    LoopbackNetwork,
    start_appliance,
)
from reduction_appliance.plugin.rendezvous import abort, leave
from reduction_appliance.plugin.rtt import Timing
from reduction_appliance.plugin.torch_backend import (
    ApplianceConfig,
    FutureWork,
    config_from_env,
    connect,
    job_name_for,
)
from reduction_appliance.plugin.torch_hook import ApplianceHookState, compressed_allreduce_hook
from reduction_appliance.plugin.torch_pump import PinnedPool, RoundPump
from tests.capabilities import needs_raw_icmp
from tests.fake_api import fake_api

from .ranks import BACKEND_CHECKS, launch_ranks, run_ranks

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rack() -> Iterator[tuple[LoopbackNetwork, ApplianceProcess]]:
    with LoopbackNetwork.create() as net, start_appliance(net, cores=1) as appliance:
        yield net, appliance


def _run(rack: tuple[LoopbackNetwork, ApplianceProcess], mode: str, world: int,
         monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    net, appliance = rack
    monkeypatch.setenv("REDUCTION_APPLIANCE", appliance.api)
    monkeypatch.delenv("REDUCTION_JOB", raising=False)
    return run_ranks(net, mode, world, timeout_s=60)


def test_backend_collectives_match_gloo(rack: tuple[LoopbackNetwork, ApplianceProcess],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = _run(rack, "backend", 3, monkeypatch)
    for rank, records in enumerate(outputs):
        seen = {(r["check"], r.get("dtype"), r.get("op")) for r in records}
        assert seen == BACKEND_CHECKS, f"rank {rank}: {seen ^ BACKEND_CHECKS}"
        failed = [r for r in records if not r["ok"]]
        assert not failed, f"rank {rank}: {failed}"


def test_buckets_sent_in_bf16_are_averaged_in_fp32_and_rounded_once(
        rack: tuple[LoopbackNetwork, ApplianceProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """`compressed_allreduce_hook` on the backend and a hook state's `compress=`: half the
    bytes each way, and the result is the ranks' bf16 buckets summed in fp32 and rounded once,
    nearer the exact average than Gloo's ring makes of the same buckets."""
    monkeypatch.setenv("REDUCTION_DETERMINISTIC", "1")
    outputs = _run(rack, "compressed", 3, monkeypatch)
    for rank, records in enumerate(outputs):
        assert {r["check"] for r in records} == {"compressed-backend", "compressed-hook"}, rank
        assert all(r["ok"] for r in records), f"rank {rank}: {records}"


def test_only_a_16_bit_dtype_compresses_a_bucket() -> None:
    with pytest.raises(ValueError, match=r"compress=torch\.float64: choose torch\.bfloat16"):
        ApplianceHookState(compress=torch.float64)
    with pytest.raises(ValueError, match=r"torch\.bfloat16 or torch\.float16, not torch\.int8"):
        compressed_allreduce_hook(torch.int8, None)


def test_ddp_hook_matches_gloo(rack: tuple[LoopbackNetwork, ApplianceProcess],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = _run(rack, "ddp", 2, monkeypatch)
    for rank, records in enumerate(outputs):
        assert {r["check"] for r in records} == {"ddp-identical", "ddp-vs-gloo"}, rank
        assert all(r["ok"] for r in records), f"rank {rank}: {records}"
    first = next(r for r in outputs[0] if r["check"] == "ddp-vs-gloo")
    assert first["hooked"] < first["first"]  # it trained
    assert first["staged"] == [False]  # one host: every rank talks to the appliance


def test_one_configured_job_name_gives_each_group_and_hook_state_a_job(
        rack: tuple[LoopbackNetwork, ApplianceProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """REDUCTION_JOB names the default group's job; later groups on the backend and DDP hook
    states get names of their own from it, alike on every rank, and each reduces (a second
    group once failed to register: the name was taken with another world size)."""
    net, appliance = rack
    monkeypatch.setenv("REDUCTION_APPLIANCE", appliance.api)
    monkeypatch.setenv("REDUCTION_JOB", "named-test")
    outputs = run_ranks(net, "named", 3, timeout_s=60)
    want = {"named-world": "named-test", "named-sub": "named-test.pg1",
            "named-every": "named-test.pg2", "named-hook0": "named-test.hook0",
            "named-hook1": "named-test.hook1", "named-hook2": "named-test.rank1.hook0"}
    for rank, records in enumerate(outputs):
        assert all(r["ok"] for r in records), f"rank {rank}: {records}"
        seen = {r["check"]: r.get("job") for r in records}
        outside = {1: "named-sub", 0: "named-hook2"}.get(rank)  # groups without this rank
        expected = {k: v for k, v in want.items() if k != outside}
        if rank == 0:
            expected["named-outsider"] = None
        assert seen == expected, f"rank {rank}"


def test_a_torchrun_restart_rejoins_under_the_configured_name(
        rack: tuple[LoopbackNetwork, ApplianceProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarts both ranks after rank 1 dies. The second attempt once failed in the
    backend's own Gloo group (it read the first attempt's addresses from the store torchrun
    keeps), and under REDUCTION_JOB its registration was refused (the dead job held the
    name, with another secret). Now it joins the name afresh and reduces exactly."""
    net, appliance = rack
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("REDUCTION_APPLIANCE", appliance.api), ("REDUCTION_JOB", "elastic"),
                        ("REDUCTION_LOCAL_ADDRESS", "127.0.0.1"), ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(name, value)
    proc = net.popen_worker(0, [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "tests.plugin.elastic_worker"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]
    assert sorted((r["rank"], r["attempt"], r["job"], r["exact"]) for r in records) == [
        (0, 1, "elastic", 20), (1, 1, "elastic", 20)]


def test_a_rank_refused_by_one_appliance_withdraws_from_the_others() -> None:
    """The second of two appliances refuses this rank's registration, or its join. The rank
    raises, and first withdraws from the appliance that took it: left there, the job held its
    slots and its name (403 to the restarted workers' new secret) for the idle timeout."""
    refusal = json.dumps({"error": "the test's appliance refuses it"}).encode()
    with LoopbackNetwork.create(multicast=False) as net, \
            start_appliance(net, cores=1, multicast=False) as appliance:
        for refused in ("register", "join"):
            name = f"withdrawn-{refused}"
            plan = Registry(parse({})).plan(JobRequest(name, 2), cookie=3, secret="s", now=0.0)
            taken = json.dumps(plan.describe(parse({})).to_json()).encode()
            answers = [(409, refusal)] if refused == "register" else [(201, taken),
                                                                       (403, refusal)]

            def answer(n: int, answers: list[tuple[int, bytes]] = answers) -> tuple[int, bytes]:
                return answers[n - 1] if n <= len(answers) else (404, b'{"error": "no job"}')

            with fake_api(answer) as (other, asked):
                config = ApplianceConfig((appliance.api, other), None, None, "127.0.0.1", False)
                with pytest.raises(ReductionError, match="the test's appliance refuses it"):
                    connect(config, name, "withdrawn-secret", 0, 2)
            assert not appliance.local_api.get("/v1/jobs"), refused
            if refused == "join":  # the other appliance was asked to let the rank go too
                assert asked[-1].endswith("/leave"), asked


def test_a_rank_that_connects_after_its_peer_aborted_the_job_fails_at_once_saying_why() -> None:
    """Rank 0 joined and aborted the job (its path too narrow, say); rank 1's process started
    late and connects after that. It once made a fresh job and waited there for the group's
    timeout (30 minutes by default); it now fails at once with the abort's reason, and leaves
    no job behind."""
    with LoopbackNetwork.create(multicast=False) as net, \
            start_appliance(net, cores=1, multicast=False) as appliance:
        config = ApplianceConfig((appliance.api,), None, None, "127.0.0.1", False)
        first, _ = connect(config, "late-torch", "the-run's-secret", 0, 2)
        try:
            abort(first.jobs[0], 0, "the test aborts it")
        finally:
            first.close()
        started = time.monotonic()
        with pytest.raises(JobAborted) as told:
            connect(config, "late-torch", "the-run's-secret", 1, 2)
        assert time.monotonic() - started < 10, told.value
        said = str(told.value)
        assert "rank 1 came after its run had ended: job " in said, said
        assert "('late-torch') was aborted (at rank 0's request: the test aborts it)" in said
        assert appliance.local_api.get("/v1/jobs") == []


def test_ranks_wait_for_a_checkpointing_peer_as_long_as_the_group_allows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 writes a checkpoint while the others wait at the next collective (a barrier, the
    next DDP step's bucket), longer than the appliance's advised deadline: they once failed
    with AllreduceTimeout at that deadline (60 s by default), though the group's timeout,
    torch's contract for how long a collective may wait, was 30 minutes."""
    with LoopbackNetwork.create(multicast=False) as net, \
            start_appliance(net, cores=1, multicast=False, deadline_s=2.0) as appliance:
        monkeypatch.setenv("REDUCTION_APPLIANCE", appliance.api)
        outputs = run_ranks(net, "patience", 2, timeout_s=90)
    for rank, records in enumerate(outputs):
        assert {r["check"]: r["ok"] for r in records} == {"backend-waits": True,
                                                          "hook-waits": True}, rank


def test_a_ddp_step_whose_buckets_cannot_be_reduced_raises_from_backward(
        rack: tuple[LoopbackNetwork, ApplianceProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer stopped mid-training (or the appliance restarted, or a timeout): the backend's
    failed allreduce reached DDP's reducer as a future completed with the exception object for
    its value, and the process died of SIGSEGV inside backward(), no word of why. Now backward()
    raises the appliance's reason, on the backend as through the hook."""
    outputs = _run(rack, "stranded", 2, monkeypatch)
    assert outputs[1] == []
    for record in outputs[0]:
        assert record["raised"] == "RuntimeError", record
        assert "RankLeft: rank 1 (" in record["message"] and "left job" in record["message"], \
            record
    assert [r["check"] for r in outputs[0]] == ["stranded-backend", "stranded-hook"]


def test_a_rank_whose_script_raises_leaves_as_it_exits_and_its_peer_hears_at_once(
        rack: tuple[LoopbackNetwork, ApplianceProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that raises ends without destroy_process_group or closing its hook state:
    both leave their jobs as the interpreter exits, so the peer's next DDP step fails with
    RankLeft, on the backend and through the hook, not with RankSilent after the liveness
    timeout."""
    net, appliance = rack
    monkeypatch.setenv("REDUCTION_APPLIANCE", appliance.api)
    monkeypatch.delenv("REDUCTION_JOB", raising=False)
    procs = launch_ranks(net, "crashed", 2)
    outputs = [proc.communicate(timeout=60) for proc in procs]
    assert procs[1].returncode != 0 and "the data loader failed" in outputs[1][1], outputs[1][1]
    records = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    assert [r["check"] for r in records] == ["crashed-backend", "crashed-hook"], outputs[0]
    for record in records:
        assert record["raised"] == "RuntimeError", (record, outputs[0][1][-2000:])
        assert "RankLeft: rank 1 (" in record["message"], record


@needs_raw_icmp
def test_a_rank_killed_outright_is_named_ended_to_its_peer_in_about_a_second(
        rack: tuple[LoopbackNetwork, ApplianceProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """The last rank is SIGKILLed between DDP steps (the OOM killer): it leaves nothing. Rank
    0's next step raises from backward() with RankEnded, on the backend and through the hook,
    not with RankSilent after the liveness timeout (5 s each)."""
    net, appliance = rack
    monkeypatch.setenv("REDUCTION_APPLIANCE", appliance.api)
    monkeypatch.delenv("REDUCTION_JOB", raising=False)
    procs = launch_ranks(net, "killed", 2)
    outputs = [proc.communicate(timeout=60) for proc in procs]
    assert procs[1].returncode == -signal.SIGKILL, outputs[1][1][-2000:]
    records = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    assert [r["check"] for r in records] == ["killed-backend", "killed-hook", "killed-took"], \
        outputs[0]
    for record in records[:2]:
        assert record["raised"] == "RuntimeError", (record, outputs[0][1][-2000:])
        assert "RankEnded: rank 1 (" in record["message"], record
    print(f"\nrank 1 killed: rank 0's two steps raised after {records[2]['seconds']} s "
          "(liveness timeout 5 s)")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it dies
def test_a_collective_whose_completion_kills_the_pump_fails_instead_of_hanging() -> None:
    """The pump thread once died while completing a collective (writing its result back) and
    left that collective's future pending: its caller waited forever. Now it fails with the
    reason, and so does every later submission."""
    with LoopbackNetwork.create(multicast=False) as net, \
            start_appliance(net, cores=1, multicast=False) as appliance:
        config = ApplianceConfig((appliance.api,), None, None, "127.0.0.1", False)
        client, jobs = connect(config, "pump-death", "pump-death-secret", 0, 1)
        pump = RoundPump(client, "test")

        def broken(coll: Any) -> None:
            raise RuntimeError("the write back broke")

        pump._write_back = broken  # type: ignore[method-assign]
        try:
            with pytest.raises(ReductionError, match=r"round pump died.*the write back broke"):
                FutureWork(pump.submit([torch.ones(10)], "sum")).wait()
            with pytest.raises(ReductionError, match="closed: its thread died"):
                FutureWork(pump.submit([torch.ones(10)], "sum")).wait()
        finally:
            pump.close()
            for info in jobs:
                leave(info, 0)
            client.close()
        # Closing a pump whose thread died still releases its socket pair (it once returned
        # early, as if closed already, and left both descriptors open).
        assert pump._wake.fileno() == -1 and pump._waker.fileno() == -1


def test_pinned_pool_reuses_the_smallest_buffer_that_fits() -> None:
    """CUDA tensors are staged through these host buffers: one taken per round, given back
    after, so a training loop allocates (and pins) its staging once, not per all_reduce."""
    pool = PinnedPool()
    big, small = pool.take(torch.float32, 1000), pool.take(torch.float32, 10)
    assert big.numel() == 1000 and small.numel() == 10 and big.dtype == torch.float32
    pool.give_back(big)
    pool.give_back(small)
    assert pool.take(torch.float32, 8).data_ptr() == small.data_ptr()  # the smaller one fits
    assert pool.take(torch.float32, 500).data_ptr() == big.data_ptr()
    fresh = pool.take(torch.float32, 2000)  # none left: a new one
    assert fresh.numel() == 2000 and fresh.data_ptr() not in (big.data_ptr(), small.data_ptr())
    pool.give_back(fresh)
    half = pool.take(torch.bfloat16, 100)  # buffers are kept per dtype
    assert half.dtype == torch.bfloat16 and half.data_ptr() != fresh.data_ptr()
    assert pool.take(torch.float16, 0).numel() == 1  # an empty tensor still gets a buffer


def _train_ddp() -> Any:
    from reduction_appliance.bench.ddp_steps import EXAMPLE

    if (loaded := sys.modules.get("train_ddp")) is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_ddp"] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("device", "reason"), [
    ("tpu", "Expected one of cpu, cuda"), ("cuda:x", "Invalid device string"),
    ("meta", "cpu or cuda"),
])
def test_the_example_refuses_a_device_it_cannot_train_on(
        device: str, reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    example = _train_ddp()
    base = ["--rank", "0", "--world", "1", "--init-method", "tcp://127.0.0.1:1"]
    assert example.parse_args([*base, "--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        example.parse_args([*base, "--device", device])
    assert reason in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is valid")
def test_cuda_without_a_gpu_is_refused_up_front(capsys: pytest.CaptureFixture[str]) -> None:
    from reduction_appliance.bench import ddp_steps

    base = ["--rank", "0", "--world", "1", "--init-method", "tcp://127.0.0.1:1"]
    with pytest.raises(SystemExit):
        _train_ddp().parse_args([*base, "--device", "cuda"])
    assert "sees no GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ddp_steps.parse_args(["--device", "cuda"])
    assert "sees no GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ddp_steps.parse_args(["--device", "gpu"])
    assert "cpu or cuda" in capsys.readouterr().err
    plan, _ = ddp_steps.parse_args([])
    assert plan.device == "cpu" and plan.options()[-2:] == ["--device", "cpu"]


def test_ddp_steps_puts_ranks_on_hosts_only_where_they_fill_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    from reduction_appliance.bench import ddp_steps

    with pytest.raises(SystemExit):
        ddp_steps.parse_args(["--workers", "4", "--ranks-per-host", "3"])
    assert "--ranks-per-host 3: a whole divisor of --workers 4" in capsys.readouterr().err
    plan, _ = ddp_steps.parse_args(["--workers", "4", "--ranks-per-host", "2"])
    assert plan.ranks_per_host == 2


def test_missing_appliance_names_the_variable() -> None:
    with pytest.raises(ReductionError, match="REDUCTION_APPLIANCE"):
        config_from_env({})
    config = config_from_env({"REDUCTION_APPLIANCE": " a:1, b:2 ", "REDUCTION_DETERMINISTIC": "1"})
    assert config.appliances == ("a:1", "b:2") and config.deterministic
    assert config.local_address == "0.0.0.0" and config.job is None and config.token is None
    assert config.lanes == 1
    assert config_from_env({"REDUCTION_APPLIANCE": "a:1", "REDUCTION_LANES": "2"}).lanes == 2
    with pytest.raises(ReductionError, match=r"REDUCTION_LANES.*'zero'"):
        config_from_env({"REDUCTION_APPLIANCE": "a:1", "REDUCTION_LANES": "zero"})
    both = config_from_env({"REDUCTION_APPLIANCE": "http://a:1/, [fd00::1]:2"}).appliances
    assert both == ("a:1", "[fd00::1]:2")
    # A bad second address is refused before the first appliance is asked.
    with pytest.raises(ReductionError, match=r"'b' is not an appliance API address.*"
                                             r"REDUCTION_APPLIANCE"):
        config_from_env({"REDUCTION_APPLIANCE": "a:1,b"})


def test_job_names_from_one_configured_name_stay_within_the_appliances_rule() -> None:
    assert job_name_for("train", "") == "train"
    assert job_name_for("train", "pg1") == "train.pg1"
    assert job_name_for("train", "pg a/b") == "train.pg-a-b"  # only letters, digits, ._:@+=-
    long = job_name_for("x" * 128, "rank3.hook12")
    assert len(long) == 128 and long.endswith("x.rank3.hook12")  # the tag survives


def test_appliance_errors_surface_from_wait() -> None:
    """Only rank 0 of 2 shows up: the round times out, and wait() raises instead of hanging;
    the pump goes on serving later calls."""
    with LoopbackNetwork.create(multicast=False) as net, \
            start_appliance(net, cores=1, multicast=False) as appliance:
        config = ApplianceConfig((appliance.api,), None, None, "127.0.0.1", False, lanes=2)
        client, jobs = connect(config, "lonely", "lonely-secret", 0, 2)
        client.rtt.timing = Timing(deadline=1.0)
        pump = RoundPump(client, "test")
        try:
            work = FutureWork(pump.submit([torch.ones(100)], "sum"))
            with pytest.raises(AllreduceTimeout, match=r"still waits for ranks \[1\]"):
                work.wait()
            bad = FutureWork(pump.submit([torch.ones(3, dtype=torch.int32)], "sum"))
            with pytest.raises(ReductionError, match=r"not torch\.int32"):
                bad.wait()
            empty = FutureWork(pump.submit([], "sum"))
            assert empty.wait() and empty.get_future().value() == []
            # abort(): an outstanding round fails at once (not with the timeout it would hit).
            client.rtt.timing = Timing(deadline=60.0)
            stuck = FutureWork(pump.submit([torch.ones(100)], "sum"))
            pump.close(abandon=True)
            with pytest.raises(ReductionError, match="the process group was aborted"):
                stuck.wait()
        finally:
            pump.close()
            with pytest.raises(ReductionError, match="closed"):
                pump.submit([torch.ones(1)], "sum").wait()
            for info in jobs:
                leave(info, 0)
            client.close()
