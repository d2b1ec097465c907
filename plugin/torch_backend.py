"""A `torch.distributed` backend named "reduction": allreduce and barrier through the appliance.

Importing this module registers the backend::

    import reduction_appliance.plugin.torch_backend  # noqa: F401
    dist.init_process_group(backend="reduction", init_method="tcp://...", rank=r, world_size=n)

Configuration comes from the environment:

``REDUCTION_APPLIANCE``
    required: the API ``host:port`` of each appliance, comma-separated (segments are spread over
    all of them).
``REDUCTION_TOKEN``
    the appliances' API token, if they require one.
``REDUCTION_JOB``
    the job name; by default rank 0 makes one up and the other ranks read it from the c10d store
    the backend is created with, so every rank of a process group joins the same job. Each
    process group is a job of its own: the default group takes this name as it is, every
    later group on the backend (``dist.new_group``) the name with ``.pg<group name>`` added,
    and the DDP hook's states names of their own (`plugin.torch_hook`).
``REDUCTION_JOB_SECRET``
    the job's join secret; by default rank 0 makes one up and shares it through the same store
    (only the holder of a job's secret may join it and learn its cookie).
``REDUCTION_LOCAL_ADDRESS``
    this worker's address on the data network (default ``0.0.0.0``).
``REDUCTION_DETERMINISTIC``
    ``1``/``true``/``yes``: register the job as deterministic (bitwise identical results).
``REDUCTION_LANES``
    how many allreduces may be on the wire at once (default 1; the job's slots on each core are
    split between them, so it may not exceed the appliance's ``jobs.slots``). More than one
    lets several small async all_reduces overlap their round trips; DDP's buckets ran fastest
    with 1 (see ``DEFAULT_LANES``). Every rank of a job must use the same value.
``REDUCTION_TRANSPORT``
    ``udp`` (default), ``roce`` (RDMA queue pairs: every rank needs an RDMA device on its
    ``REDUCTION_LOCAL_ADDRESS``, the appliance a ``[roce]`` device; docs/roce.md) or ``auto``
    (RoCE where both ends can, else UDP, said once at INFO).
``REDUCTION_HIERARCHY``
    ``auto`` (default): where several ranks of a group share a host (the same host name and
    ``REDUCTION_LOCAL_ADDRESS``) and the group spans two hosts or more, they reduce on the host
    first and one of them talks to the appliance (`plugin.torch_hosts`), unless the job is
    deterministic; ``flat``: every rank talks to the appliance.

What goes where:

* ``allreduce`` of float32, float16 and bfloat16 tensors with SUM, AVG, MIN or MAX goes through
  the appliance. Other dtypes and PRODUCT/BAND/BOR/BXOR are delegated to Gloo; AVG on a dtype the
  appliance does not reduce raises ``ValueError`` (Gloo has no AVG). ``allreduce_coalesced``
  runs one appliance round per tensor, overlapped like separate calls.
* ``barrier`` is an allreduce of a one-element tensor through the appliance.
* Every other collective (broadcast, allgather, all_gather_single, allgather_coalesced,
  gather, scatter, reduce, reduce_scatter, reduce_scatter_single, alltoall, all_to_all_single,
  send, recv, recv_anysource, monitored_barrier, ...) is delegated to a Gloo process group
  created alongside from the same store (under the prefix ``gloo``).

Appliance work runs on one background thread per process group (`plugin.torch_pump`), started
in the order it was issued, with up to ``REDUCTION_LANES`` rounds on the wire at once:
``async_op=True`` returns at once, outstanding all_reduces queue (or overlap, with lanes), and
the returned Work's ``wait()`` / ``get_future()`` finish when that call's rounds do. An
appliance error (`AllreduceTimeout`, `JobAborted`, any `ReductionError`) is set on the future
and raised from ``wait()``, never a hang.

CUDA tensors are copied into pinned host buffers (a pool, reused), reduced, and copied back
(`plugin.torch_pump`). No development machine has had a GPU yet: on one, `python -m
reduction_appliance.bench.ddp_steps --device cuda` trains on it through this path.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllreduceOptions,
    PrefixStore,
    ProcessGroup,
    ReduceOp,
    Store,
)

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.registration import JOB_NAME_CHARS, JOB_NAME_MAX

from .client import ApplianceClient
from .rendezvous import JobInfo, api_address, leave_quietly, register
from .rtt import Timing
from .torch_hosts import HIERARCHIES, HostLayout, HostStage, host_key, open_stage
from .torch_pump import APPLIANCE_DTYPES, RoundPump

__all__ = [
    "APPLIANCE_DTYPES",
    "ApplianceConfig",
    "ApplianceProcessGroup",
    "FutureWork",
    "config_from_env",
    "create_appliance_pg",
    "job_name_for",
    "leave_at_exit",
]

BACKEND_NAME = "reduction"
# One round on the wire at a time by default: measured on the 4-rank rack (bench.ddp_steps,
# 1 Gbit/s, three interleaved runs per value), DDP steps were fastest with 1 lane (1.26-1.32x
# Gloo), then 2 (1.20-1.29x), then 4 (1.19-1.25x), and alike at 500 Mbit/s: every round costs
# CPU on both ends, and a lone collective has every slot anyway (`RoundPipeline.rounds_for`).
# More lanes let several small all_reduces wait out their round trips together.
DEFAULT_LANES = 1
_KEYS = "reduction_appliance"  # this backend's keys in a group's c10d store
# How long a rank that failed to connect spends withdrawing from each appliance it reached.
_WITHDRAW_S = 5.0


@dataclass(frozen=True)
class ApplianceConfig:
    appliances: tuple[str, ...]
    token: str | None
    job: str | None
    local_address: str
    deterministic: bool
    lanes: int = DEFAULT_LANES
    secret: str | None = None
    transport: str = "udp"  # udp, roce or auto (REDUCTION_TRANSPORT)
    hierarchy: str = "auto"  # auto or flat (REDUCTION_HIERARCHY)


def config_from_env(environ: dict[str, str] | None = None) -> ApplianceConfig:
    """Read the REDUCTION_* variables (see the module docstring)."""
    env = os.environ if environ is None else environ
    raw = env.get("REDUCTION_APPLIANCE", "")
    given = [a for a in raw.split(",") if a.strip()]
    if not given:
        raise ReductionError(
            "REDUCTION_APPLIANCE is not set: give the appliance API address(es) as "
            "host:port[,host:port...]"
        )
    # Each checked before any is asked: one bad address found after the first appliance
    # registered this rank would leave that registration to withdraw.
    appliances = tuple(api_address(a) for a in given)
    raw_lanes = env.get("REDUCTION_LANES", "").strip() or str(DEFAULT_LANES)
    try:
        lanes = int(raw_lanes)
    except ValueError:
        lanes = 0
    if lanes < 1:
        raise ReductionError(f"REDUCTION_LANES must be a whole number >= 1, not {raw_lanes!r}")
    hierarchy = env.get("REDUCTION_HIERARCHY", "").strip().lower() or "auto"
    if hierarchy not in HIERARCHIES:
        raise ReductionError(f"REDUCTION_HIERARCHY must be one of {', '.join(HIERARCHIES)}, "
                             f"not {hierarchy!r}")
    return ApplianceConfig(
        appliances=appliances,
        token=env.get("REDUCTION_TOKEN") or None,
        job=env.get("REDUCTION_JOB") or None,
        secret=env.get("REDUCTION_JOB_SECRET") or None,
        local_address=env.get("REDUCTION_LOCAL_ADDRESS") or "0.0.0.0",
        deterministic=env.get("REDUCTION_DETERMINISTIC", "").strip().lower()
        in {"1", "true", "yes", "on"},
        lanes=lanes,
        transport=_transport(env.get("REDUCTION_TRANSPORT", "")),
        hierarchy=hierarchy,
    )


def _transport(raw: str) -> str:
    value = raw.strip().lower() or "udp"
    if value not in ("udp", "roce", "auto"):
        raise ReductionError(f"REDUCTION_TRANSPORT must be udp, roce or auto, not {raw!r}")
    return value


def job_name_for(base: str, tag: str) -> str:
    """The job a process group (or hook state) tagged `tag` joins when REDUCTION_JOB is `base`:
    `base` itself for no tag, else `base.tag`, within the appliance's rule for names (1..128
    of letters, digits and ._:@+=-): one configured name, one job per group."""
    if not tag:
        return base
    suffix = "." + re.sub(rf"[^{JOB_NAME_CHARS}-]", "-", tag)
    return base[:max(1, JOB_NAME_MAX - len(suffix))] + suffix


def group_timeout(group: Any) -> timedelta | None:
    """The timeout `group` was made with (`init_process_group`/`new_group`'s `timeout`), as its
    backend keeps it; None where none says."""
    for device in ("cuda", "cpu"):
        with contextlib.suppress(Exception):  # (no backend for that device, no options)
            found = group._get_backend(torch.device(device)).options._timeout
            if isinstance(found, timedelta):
                return found
    return None


def new_job_name() -> str:
    return f"torch-{uuid.uuid4().hex[:16]}"


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def connect(config: ApplianceConfig, job: str, secret: str, rank: int, world_size: int,
            timeout: timedelta | None = None) -> tuple[ApplianceClient, list[JobInfo]]:
    """Register `job` at every configured appliance, join it as `rank`, and open a client.
    Where one appliance refuses (or a join fails), this rank withdraws from the others before
    raising: its registrations and joins there would otherwise hold their slots, and the job's
    name against the restarted workers' new secret, until the appliance's idle timeout.

    `timeout` is the process group's (torch's contract: a collective may wait that long for
    its peers, 30 minutes by default): a round fails once it has had no result for that
    long, not for the appliance's advised deadline (60 s), which a rank 0 writing a
    checkpoint while the others wait at the next collective outlasts. Dead peers are named
    within the liveness timeout either way."""
    registered: list[JobInfo] = []
    try:
        for appliance in config.appliances:
            registered.append(register(
                appliance, job, world_size, secret=secret, deterministic=config.deterministic,
                token=config.token, transport=config.transport,
                local_address=config.local_address))
        timing = None if timeout is None else Timing(deadline=timeout.total_seconds())
        client = ApplianceClient(registered, rank, local_address=config.local_address,
                                 lanes=config.lanes, timing=timing)
    except BaseException:
        leave_quietly(registered, rank, _WITHDRAW_S)  # best effort: the first error counts
        raise
    return client, client.jobs


class FutureWork(dist.Work):
    """A Work over a `torch.futures.Future`: `wait()` blocks until it is done and raises its
    exception (torch's own future-wrapping Work drops exceptions set from Python).

    `get_future()` gives a future that fails in C++ as well: one `set_exception`ed from Python
    is, to C++, completed with the exception object as its value, and DDP's reducer took that
    for the bucket's tensors (the process died of SIGSEGV in backward()). A callback that
    raises fails its future in C++ too; Python's `wait()` on it raises a RuntimeError that
    names the appliance's error (`FutureWork.wait` raises the error itself)."""

    def __init__(self, fut: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._fut = fut
        self._chained: torch.futures.Future[Any] | None = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        del timeout  # the client enforces its own deadline (AllreduceTimeout)
        self._fut.wait()  # raises the round's exception
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        if self._chained is None:
            self._chained = self._fut.then(_value_or_raise)
        return self._chained

    def is_completed(self) -> bool:
        return bool(self._fut.done())

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:
            return False
        return True

    def result(self) -> list[torch.Tensor]:
        return list(self._fut.wait())

    def synchronize(self) -> None:
        pass


def _value_or_raise(fut: torch.futures.Future[Any]) -> Any:
    return fut.value()  # raises the exception a failed round set


_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


def _op_name(op: Any) -> str | None:
    """"sum"/"avg"/"min"/"max" for the ReduceOps the appliance does, else None."""
    kind = getattr(op, "op", op)  # a ReduceOp instance or the RedOpType enum
    for red, name in _OPS.items():
        if kind == red:
            return name
    return None


# ---- the process group ----

# The collectives delegated to Gloo, by ProcessGroup method name.
DELEGATED = (
    "broadcast", "allgather", "_allgather_base", "all_gather_single", "allgather_coalesced",
    "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
    "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall",
    "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource", "monitored_barrier",
)


class ApplianceProcessGroup(ProcessGroup):
    """allreduce and barrier through the appliance; everything else through Gloo (see the
    module docstring)."""

    def __init__(self, store: Store, rank: int, world_size: int, timeout: timedelta,
                 config: ApplianceConfig, job_tag: str = "") -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        self._rank = rank
        self._world_size = world_size
        # A launcher's store may outlive the workers: torchrun's rendezvous keeps one across
        # restarts, and what a dead incarnation wrote there (its Gloo addresses, its job) would
        # be read as this one's. Each rank counts, in the store, its incarnations whose Gloo
        # group came up (they came up together, on every rank), and keys this one's by the
        # count: alike on every rank, also where a rank died before it got here (counting
        # incarnations as they began, the others had counted one more, and the next attempt's
        # ranks waited for each other under different keys until Gloo's timeout).
        counted = f"{_KEYS}/incarnations/{rank}"
        incarnation = store.add(counted, 0)
        keys = PrefixStore(f"{_KEYS}/{incarnation}", store)
        gloo_store = PrefixStore("gloo", keys)
        gloo = dist.ProcessGroupGloo(gloo_store, rank, world_size, timeout)
        store.add(counted, 1)
        self.gloo = ProcessGroup(gloo_store, rank, world_size)
        self.gloo._set_default_backend(ProcessGroup.BackendType.GLOO)
        # Gloo takes CUDA tensors too (it stages them): without the second entry every
        # delegated collective on a GPU, DDP's broadcast of the model at its start among them,
        # fails with "No backend type associated with device type cuda".
        for device in ("cpu", "cuda"):
            self.gloo._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO,
                                        gloo)
        # Rank 0 names the job and makes up its secret unless configured; the others read both
        # from the store every rank of the group shares.
        if rank == 0:
            keys.set("job", job_name_for(config.job, job_tag) if config.job
                      else new_job_name())
            keys.set("secret", config.secret or new_secret())
        job = keys.get("job").decode()
        secret = keys.get("secret").decode()
        self.job = job
        name = f"reduction-appliance-{job}-{rank}"
        # This rank's rank in the appliance's job: its host's, where the group is staged.
        self.appliance_rank = rank
        self.client: ApplianceClient | None = None
        self.jobs: list[JobInfo] = []
        layout = (HostLayout.gather(keys, rank, world_size, host_key(config.local_address))
                  if config.hierarchy == "auto" and not config.deterministic else None)
        self._pump: RoundPump | HostStage
        if layout is not None and layout.staged:
            def connect_leader(host: int, hosts: int) -> RoundPump:
                self.client, self.jobs = connect(config, job, secret, host, hosts, timeout)
                self.appliance_rank = host
                return RoundPump(self.client, f"{name}-leader")

            self.layout: HostLayout | None = layout
            self._pump = open_stage(keys, rank, world_size, timeout, layout, connect_leader,
                                    name, on_broken=self._leave)
        else:
            self.layout = None
            self.client, self.jobs = connect(config, job, secret, rank, world_size, timeout)
            self._pump = RoundPump(self.client, name)
        self._shut = False
        leave_at_exit(self)

    # -- identity --
    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def name(self) -> str:  # type: ignore[override]
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"ApplianceProcessGroup(job={self.job!r}, rank={self._rank}/{self._world_size})"

    # -- appliance collectives --
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]
        tensor_list: list[torch.Tensor] = (
            [tensors] if isinstance(tensors, torch.Tensor) else list(tensors))
        if opts is None:
            opts = AllreduceOptions()
        elif not isinstance(opts, AllreduceOptions):  # allreduce(tensors, ReduceOp)
            op, opts = opts, AllreduceOptions()
            opts.reduceOp = op
        op_name = _op_name(opts.reduceOp)
        ours = op_name is not None and all(t.dtype in APPLIANCE_DTYPES for t in tensor_list)
        if not ours:
            if op_name == "avg":
                raise ValueError(
                    "ReduceOp.AVG through the reduction backend needs float32, float16 or "
                    f"bfloat16 tensors, not {sorted({str(t.dtype) for t in tensor_list})}")
            return self.gloo.allreduce(tensor_list, opts)
        assert op_name is not None
        return FutureWork(self._pump.submit(tensor_list, op_name))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        return self.allreduce(list(tensors), opts)

    def barrier(self, opts: Any = None) -> Any:
        del opts
        return FutureWork(self._pump.submit([torch.zeros(1, dtype=torch.float32)], "sum"))

    # -- lifetime --
    def shutdown(self) -> None:
        """Finish queued rounds, leave the job at every appliance, close the client and Gloo."""
        self._stop(abandon=False)

    def abort(self) -> None:
        """Like shutdown, but outstanding all_reduces fail at once instead of finishing."""
        self._stop(abandon=True)

    def _leave(self) -> None:
        """Leave the job at every appliance (the others are told at once); once is enough."""
        jobs, self.jobs = self.jobs, []
        leave_quietly(jobs, self.appliance_rank)

    def _stop(self, abandon: bool) -> None:
        if self._shut:
            return
        self._shut = True
        self._pump.close(abandon=abandon)
        self._leave()
        if self.client is not None:
            self.client.close()
        with contextlib.suppress(RuntimeError, AttributeError):
            self.gloo.shutdown()


class _Leaves(Protocol):
    jobs: list[JobInfo]
    client: ApplianceClient | None

    def _leave(self) -> None: ...


def leave_at_exit(owner: _Leaves) -> None:
    """Leave `owner`'s jobs as the interpreter exits unless it has by then: a script that
    ends without destroy_process_group (an exception of its own, Ctrl-C) lets its peers fail
    at once with RankLeft, not after the liveness timeout with RankSilent. Not where the job
    itself failed (as `ApplianceClient.__exit__`). (A weak reference: the owner may
    go first.)"""
    atexit.register(_leave_at_exit, weakref.ref(owner))


def _leave_at_exit(owner: weakref.ref[_Leaves]) -> None:
    alive = owner()
    if alive is None or not alive.jobs:
        return
    if alive.client is None or alive.client.pipeline.failed_by is None:
        with contextlib.suppress(ReductionError):  # (the hook's own `_leave` raises)
            alive._leave()


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: ApplianceProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.gloo, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"`{name}`, delegated to the Gloo group alongside."
    return method


for _name in DELEGATED:
    setattr(ApplianceProcessGroup, _name, _delegate(_name))


def create_appliance_pg(opts: Any, backend_options: Any = None) -> ApplianceProcessGroup:
    """The backend creator torch calls for `init_process_group(backend="reduction")` and for
    every `new_group` on it (`opts`: torch's `_DistributedBackendOptions`). The default group
    is created before torch records it, so a group made while none is initialised is it; every
    later one is tagged with its group name, which torch gives alike on every rank."""
    del backend_options
    tag = f"pg{opts.group_id}" if dist.is_initialized() else ""
    return ApplianceProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                 config_from_env(), job_tag=tag)


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, create_appliance_pg, extended_api=True,
                                  devices=["cpu", "cuda"])
