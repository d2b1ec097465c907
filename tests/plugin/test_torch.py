"""The PyTorch plugin against a real reductiond on loopback: the "reduction" backend and the DDP
communication hook, each rank a subprocess (see torch_worker.py), compared with Gloo."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: the PyTorch plugin needs it", allow_module_level=True)

import numpy as np
import torch

from bench.harness import ApplianceProcess, LoopbackNetwork, run_workers, start_appliance
from dataplane.errors import ReductionError
from plugin.rendezvous import leave
from plugin.session import Timing
from plugin.torch_backend import (
    ApplianceConfig,
    RoundWorker,
    _work,
    config_from_env,
    connect,
    reduce_tensor,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def rack() -> Iterator[tuple[LoopbackNetwork, ApplianceProcess]]:
    with LoopbackNetwork.create() as net, start_appliance(net, cores=1) as appliance:
        yield net, appliance


def _run(rack: tuple[LoopbackNetwork, ApplianceProcess], mode: str, world: int,
         monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    net, appliance = rack
    monkeypatch.setenv("REDUCTION_APPLIANCE", appliance.api)
    monkeypatch.setenv("REDUCTION_LOCAL_ADDRESS", net.worker_address(0))
    monkeypatch.delenv("REDUCTION_JOB", raising=False)
    port = _free_port()
    argv = [["-m", "tests.plugin.torch_worker", mode, str(r), str(world), str(port)]
            for r in range(world)]
    return run_workers(net, argv, timeout_s=60)


def test_backend_collectives_match_gloo(rack: tuple[LoopbackNetwork, ApplianceProcess],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = _run(rack, "backend", 3, monkeypatch)
    expected = {("allreduce", d, o) for d in ("fp32", "fp16", "bf16")
                for o in ("sum", "avg", "min", "max")}
    expected |= {(c, None, None) for c in ("async", "barrier", "broadcast", "delegated-int")}
    for rank, records in enumerate(outputs):
        seen = {(r["check"], r.get("dtype"), r.get("op")) for r in records}
        assert seen == expected, f"rank {rank}: {seen ^ expected}"
        failed = [r for r in records if not r["ok"]]
        assert not failed, f"rank {rank}: {failed}"


def test_ddp_hook_matches_gloo(rack: tuple[LoopbackNetwork, ApplianceProcess],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = _run(rack, "ddp", 2, monkeypatch)
    for rank, records in enumerate(outputs):
        assert {r["check"] for r in records} == {"ddp-identical", "ddp-vs-gloo"}, rank
        assert all(r["ok"] for r in records), f"rank {rank}: {records}"
    first = next(r for r in outputs[0] if r["check"] == "ddp-vs-gloo")
    assert first["hooked"] < first["first"]  # it trained


def test_missing_appliance_names_the_variable() -> None:
    with pytest.raises(ReductionError, match="REDUCTION_APPLIANCE"):
        config_from_env({})
    config = config_from_env({"REDUCTION_APPLIANCE": " a:1, b:2 ", "REDUCTION_DETERMINISTIC": "1"})
    assert config.appliances == ("a:1", "b:2") and config.deterministic
    assert config.local_address == "0.0.0.0" and config.job is None and config.token is None


def test_appliance_errors_surface_from_wait() -> None:
    """Only rank 0 of 2 shows up: the round times out, and wait() raises instead of hanging."""
    with LoopbackNetwork.create(multicast=False) as net, \
            start_appliance(net, cores=1, multicast=False) as appliance:
        config = ApplianceConfig((appliance.api,), None, None, "127.0.0.1", False)
        client, jobs = connect(config, "lonely", 0, 2)
        client.rtt.timing = Timing(deadline=1.0)
        worker = RoundWorker("test")
        try:
            t = torch.ones(100)
            work = _work(worker.submit(lambda: [reduce_tensor(client, t, "sum")]))
            with pytest.raises(ReductionError):
                work.wait()
            ok = _work(worker.submit(lambda: [torch.zeros(1)]))
            assert ok.wait()  # the thread survives a failed round
            assert np.array_equal(ok.get_future().value()[0].numpy(), np.zeros(1))
        finally:
            worker.close()
            for info in jobs:
                leave(info, 0)
            client.close()
