"""Ranks that share a host reduce there first, and one of them talks to the appliance.

A server with several GPUs and one NIC runs several ranks behind that NIC. Flat, each of them
sends its whole gradient to the appliance, so the NIC's uplink carries k gradients for k
ranks, where Gloo's ring, whose neighbours on the host talk over loopback, carries about two:
measured on the emulated rack with 2 hosts of 4 ranks at 1 Gbit/s, 16 MiB took 553 ms
flat against Gloo's 239 (0.43x). So, as NCCL's CollNet does before SHARP, the backend (and
the DDP hook on the default group) stages an allreduce on each such host (`HostStage`):

1. a Gloo reduce over the host's loopback to its lowest rank, the host's leader;
2. the leaders' allreduce through the appliance, in a job whose ranks are the hosts;
3. a Gloo broadcast from the leader of the result, then of whether step 2 worked (and if
   not, why).

The uplink then carries one gradient per host, the downlink one result. AVG is a SUM whose
result is divided by the group's size on every rank; the host's partial sums are in the
tensor's dtype, as Gloo's reduce leaves them (fp16 and bf16 round once more per host than
flat, where the appliance accumulates every rank's contribution in fp32).

Ranks share a host when they have the same host name and the same ``REDUCTION_LOCAL_ADDRESS``:
ranks given different data addresses (a NIC per GPU) stay flat. A group staged on hosts has at
least two hosts and at least one host with two ranks; every other group is flat, as before.
``REDUCTION_HIERARCHY=flat`` keeps every group flat, and so does ``REDUCTION_DETERMINISTIC``:
its promise is the appliance's sum in rank order, accumulated in fp32, bit for bit.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    BroadcastOptions,
    PrefixStore,
    ReduceOp,
    ReduceOptions,
    Store,
)

from reduction_appliance.dataplane.errors import ReductionError

from .torch_pump import RoundPump, refuse_unreducible

__all__ = ["HIERARCHIES", "HostLayout", "HostStage", "host_key"]

HIERARCHIES = ("auto", "flat")  # REDUCTION_HIERARCHY
_LOCAL_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "min": ReduceOp.MIN,
              "max": ReduceOp.MAX}
# A collective's outcome, told by the leader to its host's other ranks: a byte that says
# whether the appliance reduced it, then the leader's failure in words.
_OUTCOME_BYTES = 4096
# The pipeline's piece: the appliance's share of a step takes 35 ms of a 1 Gbit/s link per
# 4 MiB, the Gloo reduction of the next piece on the host less (measured: 4 ranks reduce and
# broadcast 16 MiB over loopback in 34 ms on this 2-core machine). Pieces of 1 MiB did no
# better with 8 ranks on 2 hosts at 4 MiB, pieces of 512 KiB worse (the Gloo calls' cost).
_PIECE_BYTES = 4 << 20
_ABANDON_S = 5.0  # how long a broken stage waits for its leader's pump to fail its rounds


def host_key(local_address: str) -> str:
    """What ranks behind one NIC have alike: the host's name and the data address."""
    return f"{socket.gethostname()}/{local_address}"


@dataclass(frozen=True)
class HostLayout:
    """The group's ranks by host: `hosts[h]` are host h's ranks in order, hosts ordered by
    their lowest rank (so every rank numbers them alike)."""

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, keys: Sequence[str]) -> HostLayout:
        """The layout of a group whose rank r has host key `keys[r]`."""
        by_key: dict[str, list[int]] = {}
        for rank, key in enumerate(keys):
            by_key.setdefault(key, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in by_key.values()))

    @classmethod
    def gather(cls, store: Store, rank: int, world_size: int, key: str) -> HostLayout:
        """Every rank's key through the group's store (each waits for all of them)."""
        store.set(f"host/{rank}", key)
        return cls.of([store.get(f"host/{r}").decode() for r in range(world_size)])

    @property
    def staged(self) -> bool:
        """Worth staging: two hosts at least, and a host with two ranks at least."""
        return len(self.hosts) >= 2 and any(len(ranks) >= 2 for ranks in self.hosts)

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def describe(self) -> str:
        """E.g. "rank 0 is ranks 0,1; rank 1 is ranks 2,3" (the appliance's rank h is host h)."""
        return "; ".join(f"rank {h} is ranks {','.join(map(str, r))}"
                         for h, r in enumerate(self.hosts))


@dataclass
class _Staged:
    """One collective on its way through the stage."""

    tensors: list[torch.Tensor]
    op: str
    future: torch.futures.Future[Any]
    ready: list[torch.cuda.Event]
    hosts: list[torch.Tensor] = field(default_factory=list)  # what Gloo reduces, in place
    pieces: list[torch.Tensor] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)  # Gloo's, waited for before the outcome
    rounds: list[torch.futures.Future[Any]] = field(default_factory=list)  # the leader's
    outcome: torch.Tensor = field(
        default_factory=lambda: torch.zeros(_OUTCOME_BYTES, dtype=torch.uint8))


class HostStage:
    """The pump of a rank in a group staged on hosts (see the module docstring): the same
    `submit` and `close` as `RoundPump`.

    Collectives overlap: while the appliance works on one piece, Gloo reduces the next one
    (of the same collective or the next: DDP's buckets come one after another) and
    broadcasts the one before. Gloo matches its collectives by the order each rank posts
    them, so the reductions go on one Gloo group and the broadcasts on another, each posted
    in the order of submission: one thread posts a collective's reductions (on the leader,
    it hands each reduced piece to the appliance), another its broadcasts (on the leader,
    each once the appliance has its result) and then its outcome (a byte for success, or
    the leader's failure in words), and completes it.

    `leader` is the host leader's pump (None on the host's other ranks). A failure of the
    host's Gloo groups (a rank gone) leaves its ranks out of step, so it fails this collective
    and every later one at once, with the reason, and calls `on_broken` once: the backend's
    leader leaves the appliance's job there, so that the other hosts hear at once that this
    one is gone instead of waiting for its share until their deadline."""

    def __init__(self, groups: tuple[Any, Any], leader: RoundPump | None, world_size: int,
                 leader_rank: int, name: str,
                 on_broken: Callable[[], None] = lambda: None, hosts: str = "") -> None:
        self._reductions, self._broadcasts = groups
        # The appliance names its job's ranks, which are hosts here: said after its errors.
        self._hosts = hosts
        self._leader = leader
        self._on_broken = on_broken
        self._world_size = world_size
        self._leader_rank = leader_rank
        self._inbox: queue.SimpleQueue[_Staged | None] = queue.SimpleQueue()
        self._posted: queue.SimpleQueue[_Staged | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._broken: BaseException | None = None
        self._abandon = False
        self._threads = [threading.Thread(target=self._post, name=f"{name}-post", daemon=True),
                         threading.Thread(target=self._complete, name=f"{name}-complete",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def local_groups(store: Store, layout: HostLayout, rank: int,
                     timeout: timedelta) -> tuple[Any, Any]:
        """This rank's two Gloo groups with the other ranks of its host, over loopback: one
        for the reductions, one for the broadcasts (`ProcessGroupGloo`s, whose stubs lack
        the collectives)."""
        host = layout.host_of(rank)
        ranks = layout.hosts[host]
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timeout
        return tuple(dist.ProcessGroupGloo(PrefixStore(f"host{host}/{use}", store),
                                           ranks.index(rank), len(ranks), options)
                     for use in ("reduce", "broadcast"))  # type: ignore[return-value]

    def submit(self, tensors: list[torch.Tensor], op: str) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ReductionError("the host stage is closed"))
                return fut
            devices = {t.device for t in tensors if t.device.type == "cuda"}
            ready = [torch.cuda.current_stream(d).record_event() for d in devices]
            self._inbox.put(_Staged(list(tensors), op, fut, ready))
        return fut

    def close(self, timeout_s: float = 60.0, *, abandon: bool = False) -> None:
        """Finish what was submitted (with `abandon`, fail it), stop the threads, then the
        leader's pump."""
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                self._abandon = abandon
                self._inbox.put(None)
        if abandon and self._leader is not None:
            self._leader.close(timeout_s, abandon=True)  # its rounds fail at once
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout_s)
        if self._leader is not None:
            self._leader.close(timeout_s, abandon=abandon)

    # ---- the threads ----
    def _refusal(self) -> ReductionError | None:
        if self._abandon:
            return ReductionError("the process group was aborted")
        if self._broken is not None:
            return ReductionError(f"this host's group of ranks failed before: {self._broken}")
        return None

    def _break(self, item: _Staged, exc: BaseException) -> None:
        with self._lock:
            first = self._broken is None
            if first:
                self._broken = exc
        if first:
            # Before the caller hears: a process that ends on this error must have left.
            with contextlib.suppress(Exception):  # best effort: the caller has the reason
                self._on_broken()
            if self._leader is not None:
                # Its rounds in flight can never be broadcast: failed at once, they do not
                # hold up a shutdown after this (closing waits for rounds still running).
                with contextlib.suppress(Exception):
                    self._leader.close(_ABANDON_S, abandon=True)
        if not item.future.done():
            item.future.set_exception(ReductionError(
                f"this host's group of ranks failed (a rank gone?): {exc}"))

    def _post(self) -> None:
        try:
            while (item := self._inbox.get()) is not None:
                if (refused := self._refusal()) is not None:
                    item.future.set_exception(refused)
                elif self._prepare(item):
                    try:
                        self._post_one(item)
                    except Exception as exc:
                        self._break(item, exc)
                        continue
                    self._posted.put(item)
        finally:
            self._posted.put(None)

    def _prepare(self, item: _Staged) -> bool:
        """The host copies and pieces of `item`'s tensors; False (the collective failed
        alone, before any step) for a tensor the appliance cannot reduce."""
        try:
            for t in item.tensors:
                refuse_unreducible(t)
            for event in item.ready:
                event.synchronize()
            item.hosts = [_host_copy(t) for t in item.tensors]
        except Exception as exc:
            item.future.set_exception(exc)
            return False
        item.pieces = [piece for host in item.hosts for piece in _pieces(host.view(-1))]
        return True

    def _post_one(self, item: _Staged) -> None:
        reduce = ReduceOptions()
        reduce.rootRank = 0
        reduce.reduceOp = ReduceOp(_LOCAL_OPS[item.op])
        reductions = [self._reductions.reduce([piece], reduce) for piece in item.pieces]
        item.works.extend(reductions)
        if self._leader is None:
            for piece in (*item.pieces, item.outcome):
                item.works.append(self._broadcasts.broadcast([piece], _from_leader()))
            return
        for piece, reduction in zip(item.pieces, reductions, strict=True):
            reduction.wait()
            item.rounds.append(self._leader.submit([piece],
                                                   "sum" if item.op == "avg" else item.op))

    def _complete(self) -> None:
        while (item := self._posted.get()) is not None:
            if (refused := self._refusal()) is not None:
                item.future.set_exception(refused)
                continue
            try:
                failure = self._broadcast_results(item) if self._leader is not None else None
                for work in item.works:
                    work.wait()
            except Exception as exc:
                self._break(item, exc)
                continue
            self._finish(item, failure)

    def _broadcast_results(self, item: _Staged) -> BaseException | None:
        """The leader's broadcasts of `item`: each piece once the appliance is done with it,
        then the outcome. The appliance's failure, if any, noted with the hosts."""
        failure: BaseException | None = None
        for piece, sent in zip(item.pieces, item.rounds, strict=True):
            try:
                sent.wait()
            except Exception as exc:  # every error of step 2 goes to the host's ranks
                failure = failure or exc
            item.works.append(self._broadcasts.broadcast([piece], _from_leader()))
        if failure is not None:
            if self._hosts:
                failure = _noted(failure, f"the appliance's ranks are this group's hosts: "
                                          f"{self._hosts}")
            said = str(failure).encode()[:_OUTCOME_BYTES - 1]
            item.outcome[0] = 1
            item.outcome[1:1 + len(said)] = torch.frombuffer(bytearray(said), dtype=torch.uint8)
        item.works.append(self._broadcasts.broadcast([item.outcome], _from_leader()))
        return failure

    def _finish(self, item: _Staged, failure: BaseException | None) -> None:
        if int(item.outcome[0]):
            if failure is None:  # a rank beside the leader: the leader's words
                text = bytes(item.outcome[1:].numpy()).rstrip(b"\0").decode(errors="replace")
                failure = ReductionError(f"rank {self._leader_rank} reduces this host's sum "
                                         f"through the appliance, and there it failed: {text}")
            item.future.set_exception(failure if isinstance(failure, ReductionError)
                                      else ReductionError(str(failure)))
            return
        if item.op == "avg":
            for host in item.hosts:
                host.div_(self._world_size)
        for t, host in zip(item.tensors, item.hosts, strict=True):
            if host is not t:
                t.detach().copy_(host.view_as(t))
        item.future.set_result(item.tensors)


def _from_leader() -> BroadcastOptions:
    root = BroadcastOptions()
    root.rootRank = 0
    return root


def _noted(failure: BaseException, note: str) -> BaseException:
    """`failure` again, of its class where it can be, with `note` after its words."""
    if isinstance(failure, ReductionError):
        with contextlib.suppress(Exception):
            return type(failure)(f"{failure} ({note})")
    return ReductionError(f"{failure} ({note})")


def _pieces(flat: torch.Tensor) -> list[torch.Tensor]:
    """`flat` cut into views of about `_PIECE_BYTES` (one, if it is smaller)."""
    count = max(1, -(-flat.numel() * flat.element_size() // _PIECE_BYTES))
    return list(torch.tensor_split(flat, count))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` itself where Gloo can reduce it in place (a contiguous CPU tensor), else a
    contiguous CPU copy, written back after."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t.detach()
    return t.detach().to("cpu", copy=True).contiguous()


def open_stage(store: Store, rank: int, world_size: int, timeout: timedelta,
               layout: HostLayout, connect_leader: Callable[[int, int], RoundPump],
               name: str, on_broken: Callable[[], None]) -> HostStage:
    """This rank's stage: its host's Gloo groups, and on the host's leader, the pump that
    `connect_leader(host, hosts)` opens on the appliance job of the hosts."""
    groups = HostStage.local_groups(store, layout, rank, timeout)
    host = layout.host_of(rank)
    leader_rank = layout.hosts[host][0]
    leader = connect_leader(host, len(layout.hosts)) if rank == leader_rank else None
    try:
        return HostStage(groups, leader, world_size, leader_rank, name, on_broken,
                         layout.describe())
    except BaseException:
        if leader is not None:
            with contextlib.suppress(Exception):
                leader.close()
        raise
