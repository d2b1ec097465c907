"""Ranks that share a host (plugin.torch_hosts): the layout from the ranks' host keys, and the
stage's three steps with a real Gloo group of the host's ranks (threads of this process) and a
stand-in for the appliance behind the leader."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: the PyTorch plugin needs it", allow_module_level=True)

import torch
import torch.distributed as dist

from reduction_appliance.dataplane.errors import JobAborted, ReductionError
from reduction_appliance.plugin import torch_hosts
from reduction_appliance.plugin.torch_backend import config_from_env
from reduction_appliance.plugin.torch_hosts import HostLayout, HostStage
from tests.waiting import wait_until

LOCAL = 3  # ranks on this host
OTHER = 100.0  # what the other host's ranks add, in the stand-in appliance


def test_ranks_with_one_key_share_a_host_numbered_by_its_lowest_rank() -> None:
    layout = HostLayout.of(["b/1", "a/2", "b/1", "a/2", "c/3"])
    assert layout.hosts == ((0, 2), (1, 3), (4,))
    assert [layout.host_of(r) for r in range(5)] == [0, 1, 0, 1, 2]
    assert layout.staged
    assert layout.describe() == "rank 0 is ranks 0,2; rank 1 is ranks 1,3; rank 2 is ranks 4"


@pytest.mark.parametrize("keys", [["a", "a", "a"], ["a", "b", "c"], ["a"]])
def test_one_host_or_one_rank_per_host_stays_flat(keys: list[str]) -> None:
    assert not HostLayout.of(keys).staged


def test_the_hierarchy_is_auto_unless_set_flat_and_a_typo_is_refused() -> None:
    assert config_from_env({"REDUCTION_APPLIANCE": "a:1"}).hierarchy == "auto"
    assert config_from_env({"REDUCTION_APPLIANCE": "a:1",
                            "REDUCTION_HIERARCHY": " Flat "}).hierarchy == "flat"
    with pytest.raises(ReductionError, match="REDUCTION_HIERARCHY must be one of auto, flat, "
                                             "not 'hosts'"):
        config_from_env({"REDUCTION_APPLIANCE": "a:1", "REDUCTION_HIERARCHY": "hosts"})


class StandIn:
    """The leader's pump, with the appliance behind it: adds the other host's share (or takes
    its min/max), or fails every round with `failure`."""

    def __init__(self, failure: BaseException | None = None) -> None:
        self.failure = failure
        self.rounds: list[tuple[int, str]] = []
        self.closed: list[bool] = []  # each close(), whether it abandoned the rounds

    def submit(self, tensors: list[torch.Tensor], op: str) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self.rounds.append((sum(t.numel() for t in tensors), op))
        if self.failure is not None:
            fut.set_exception(self.failure)
            return fut
        for t in tensors:
            other = torch.full_like(t, OTHER)
            if op == "sum":
                t.add_(other)
            elif op == "min":
                torch.minimum(t, other, out=t)
            else:
                torch.maximum(t, other, out=t)
        fut.set_result(tensors)
        return fut

    def close(self, timeout_s: float = 60.0, *, abandon: bool = False) -> None:
        self.closed.append(abandon)


def _on_every_rank(body: Callable[[int, HostStage], Any], leader: StandIn,
                   world_size: int = 2 * LOCAL) -> list[Any]:
    """`body(local_rank, stage)` on each rank of a host of LOCAL ranks (threads), each with a
    real Gloo group of them and its stage; rank 0 leads, through `leader`."""
    store = dist.HashStore()
    results: list[Any] = [None] * LOCAL

    def rank(r: int) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timedelta(seconds=30)
        groups = tuple(dist.ProcessGroupGloo(dist.PrefixStore(use, store), r, LOCAL, options)
                       for use in ("reduce", "broadcast"))
        stage = HostStage(groups, leader if r == 0 else None,  # type: ignore[arg-type]
                          world_size, 0, f"stage-{r}",
                          hosts="rank 0 is ranks 0,1,2; rank 1 is ranks 3,4,5")
        try:
            results[r] = body(r, stage)
        except BaseException as exc:  # handed to the test's thread
            results[r] = exc
        finally:
            stage.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(LOCAL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank of the stage hung"
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_every_rank_gets_the_hosts_reduction_through_the_leader(
        dtype: torch.dtype, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_hosts, "_PIECE_BYTES", 1000)  # several pieces in the pipeline
    n = 1500
    leader = StandIn()

    def body(r: int, stage: HostStage) -> torch.Tensor:
        t = torch.arange(n, dtype=torch.float32).remainder(7).add(r).to(dtype)
        return stage.submit([t], op).wait()[0]

    results = _on_every_rank(body, leader)
    base = torch.arange(n, dtype=torch.float32).remainder(7)
    ranks = [base + r for r in range(LOCAL)]
    want = {"sum": sum(ranks) + OTHER, "avg": (sum(ranks) + OTHER) / (2 * LOCAL),
            "min": torch.minimum(ranks[0], torch.tensor(OTHER)),
            "max": torch.full((n,), OTHER)}[op]
    for r, got in enumerate(results):
        assert isinstance(got, torch.Tensor), (r, got)
        assert got.dtype == dtype
        assert torch.equal(got, want.to(dtype)), (r, op, got[:8], want[:8])
    # the appliance saw each piece once, as a sum for AVG
    assert sum(size for size, _ in leader.rounds) == n
    assert len(leader.rounds) == -(-n * dtype.itemsize // 1000)
    assert {o for _, o in leader.rounds} == {"sum" if op == "avg" else op}


class HeldStandIn(StandIn):
    """The stand-in, holding every round until `release()`."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[list[torch.Tensor], str, torch.futures.Future[Any]]] = []
        self.lock = threading.Lock()

    def submit(self, tensors: list[torch.Tensor], op: str) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self.lock:
            self.held.append((tensors, op, fut))
        return fut

    def release(self) -> None:
        with self.lock:
            for tensors, op, fut in self.held:
                StandIn.submit(self, tensors, op).wait()
                fut.set_result(tensors)


def test_the_next_collective_is_reduced_on_the_host_while_the_appliance_has_this_one() -> None:
    """DDP's buckets come one after another: the second reaches the appliance while the
    first's round is still out (the stand-in holds both until it has both)."""
    leader = HeldStandIn()

    def body(r: int, stage: HostStage) -> list[torch.Tensor]:
        futures = [stage.submit([torch.full((700,), float(r + bucket))], "sum")
                   for bucket in range(2)]
        if r == 0:
            wait_until(lambda: len(leader.held) == 2, 30,
                       what="the second bucket at the appliance while the first is there")
            leader.release()
        return [f.wait()[0] for f in futures]

    for first, second in _on_every_rank(body, leader):
        assert torch.equal(first, torch.full((700,), 0 + 1 + 2 + OTHER))
        assert torch.equal(second, torch.full((700,), 1 + 2 + 3 + OTHER))


def test_a_strided_tensor_is_reduced_and_written_back() -> None:
    def body(r: int, stage: HostStage) -> torch.Tensor:
        grid = torch.full((40, 30), float(r + 1))
        column = grid[:, 3]
        stage.submit([column], "sum").wait()
        return grid

    for grid in _on_every_rank(body, StandIn()):
        assert torch.equal(grid[:, 3], torch.full((40,), 1 + 2 + 3 + OTHER))
        assert torch.equal(grid[:, 2], grid[:, 4])  # the rest untouched: each rank's own


def test_the_appliances_failure_reaches_every_rank_of_the_host_and_the_next_call_works() -> None:
    leader = StandIn(JobAborted("aborted job 7 (an operator's abort)"))

    def body(r: int, stage: HostStage) -> tuple[BaseException | None, torch.Tensor]:
        failed = None
        try:
            stage.submit([torch.ones(500)], "sum").wait()
        except Exception as exc:
            failed = exc
        if r == 0:
            leader.failure = None  # the leader's next round works (the others are in step 3)
        return failed, stage.submit([torch.ones(500)], "sum").wait()[0]

    results = _on_every_rank(body, leader)
    note = "the appliance's ranks are this group's hosts: rank 0 is ranks 0,1,2; rank 1 is ranks"
    first, _ = results[0]
    assert isinstance(first, JobAborted), first  # the leader's own, of its class
    assert str(first).startswith("aborted job 7 (an operator's abort) (") and note in str(first)
    for failed, _ in results[1:]:
        assert type(failed) is ReductionError, failed
        assert str(failed).startswith("rank 0 reduces this host's sum through the appliance, "
                                      "and there it failed: aborted job 7"), failed
        assert note in str(failed)
    assert all(torch.equal(t, torch.full((500,), LOCAL + OTHER)) for _, t in results)


class BrokenHost:
    """A host's Gloo group whose peer is gone: every collective fails (once `go` is set)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self.go.wait(30)
        raise RuntimeError("Connection closed by peer [127.0.0.1]:9651")

    broadcast = reduce


def test_a_broken_host_group_leaves_fails_this_call_and_every_later_one_at_once() -> None:
    host = BrokenHost()
    host.go.clear()
    calls: list[torch.futures.Future[Any]] = []
    done_when_left: list[bool] = []
    leader = StandIn()
    stage = HostStage((host, host), leader, 4, 0, "broken",  # type: ignore[arg-type]
                      on_broken=lambda: done_when_left.append(calls[0].done()))
    try:
        calls.append(stage.submit([torch.ones(10)], "sum"))
        host.go.set()
        with pytest.raises(ReductionError, match=r"this host's group of ranks failed \(a rank "
                                                 r"gone\?\): Connection closed by peer"):
            calls[0].wait()
        with pytest.raises(ReductionError, match="this host's group of ranks failed before: "
                                                 "Connection closed"):
            stage.submit([torch.ones(10)], "sum").wait()
        assert done_when_left == [False]  # left once, before the caller heard
        assert leader.closed == [True]  # the leader's rounds in flight failed at once
    finally:
        stage.close()
    with pytest.raises(ReductionError, match="the host stage is closed"):
        stage.submit([torch.ones(10)], "sum").wait()


def test_a_tensor_the_appliance_cannot_reduce_fails_alone() -> None:
    broken = BrokenHost()
    stage = HostStage((broken, broken), StandIn(), 4, 0, "refuses")  # type: ignore[arg-type]
    try:
        with pytest.raises(ReductionError, match=r"not torch\.int64"):
            stage.submit([torch.ones(10, dtype=torch.int64)], "sum").wait()
        with pytest.raises(ReductionError, match="expand"):
            stage.submit([torch.ones(1).expand(10)], "sum").wait()
    finally:
        stage.close()
