"""One rank of the torch plugin tests:
`python -m tests.plugin.torch_worker MODE RANK WORLD STORE_HOST:PORT LOCAL_ADDRESS IFNAME`.

MODE "backend": collectives on the "reduction" backend against a Gloo group on the same ranks
(bitwise against the fixed-order reference when REDUCTION_DETERMINISTIC is set).
MODE "overlap": eight async all_reduces at once; reports how many were on the wire together.
MODE "stall": every rank but the last (the last STALLED_RANKS) calls all_reduce (which cannot
finish); reports the exception wait() raised, and after how long; then all meet at a Gloo
barrier and leave.
MODE "ddp": a tiny model in DDP with Gloo default, once with the appliance hook and once plain.
MODE "named": with REDUCTION_JOB set, several groups on the backend and several hook states.
MODE "patience": rank 0 writes a "checkpoint" (sleeps) while the others wait at the next
collective, on the backend and in a DDP step through the hook: longer than the appliance's
advised deadline, within the process group's timeout.
MODE "stranded": the last rank leaves after two DDP steps; the others' next step must fail.
MODE "loop": all_reduces until one fails (the test kills a rank), then says how it failed.
MODE "crashed": the last rank's script raises after two DDP steps, its group never destroyed;
the others' next step must fail at once, naming it as left.
MODE "killed": the last rank is SIGKILLed after two DDP steps; the others' next step must fail
within about a second, naming it as ended.
MODE "compressed" (REDUCTION_DETERMINISTIC set): a gradient bucket sent as bf16, through
`compressed_allreduce_hook` on the backend and through a hook state's `compress=`: both the
fixed-order fp32 average of the ranks' bf16 buckets, rounded once, bit for bit; and nearer the
exact average than Gloo's ring given the same bf16 buckets, divided first, as torch's compress
hooks do.
Prints one JSON line per check.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from reduction_appliance.dataplane.dtypes import DTYPES as WIRE_TABLE
from reduction_appliance.dataplane.dtypes import by_short
from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.wire import Op
from reduction_appliance.deploy.testnet.reference import random_values, reference, same_bits
from reduction_appliance.plugin.torch_backend import (  # importing registers the backend
    ApplianceProcessGroup,
    config_from_env,
)
from reduction_appliance.plugin.torch_exit import exit_without_finalizing
from reduction_appliance.plugin.torch_hook import (
    ApplianceHookState,
    appliance_allreduce_hook,
    compressed_allreduce_hook,
)
from reduction_appliance.plugin.torch_hosts import HostStage
from reduction_appliance.plugin.torch_pump import numpy_view

DTYPES = {d.short: getattr(torch, d.name) for d in WIRE_TABLE}
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX}


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def inputs(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    # Small integers: exact in every dtype and for every op (avg of world 2/4 is exact too).
    base = torch.arange(n, dtype=torch.float32)
    return ((base * (rank + 3) + salt) % 13 - 6).to(dtype)


def init(backend: str, rank: int, world: int, store: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def appliance_group() -> ApplianceProcessGroup:
    pg = dist.distributed_c10d._get_default_group()  # a Python backend is the group itself
    assert isinstance(pg, ApplianceProcessGroup), pg
    return pg


def deterministic_checks(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    """Random (non-integer) inputs: any other summation order would show in the low bits."""
    rng = np.random.default_rng(1000 + rank)
    n = 5000
    for dname, dtype in DTYPES.items():
        wire = by_short(dname).dtype
        for oname, op in OPS.items():
            mine = random_values(rng, n, wire)
            # Gathered as raw int32 bits (widened for 16-bit dtypes): Gloo has no bfloat16
            # and no int16.
            raw = torch.from_numpy(mine.view(np.int16 if mine.itemsize == 2 else np.int32).copy())
            everyone = [torch.empty(n, dtype=torch.int32) for _ in range(world)]
            dist.all_gather(everyone, raw.to(torch.int32), group=gloo)
            t = raw.view(dtype)
            dist.all_reduce(t, op=op)
            want = reference([x.to(raw.dtype).numpy().view(mine.dtype) for x in everyone],
                             Op[oname.upper()])
            emit(check="deterministic", dtype=dname, op=oname,
                 ok=bool(same_bits(numpy_view(t), want)))


def backend(rank: int, world: int, store: str) -> None:
    init("reduction", rank, world, store)
    gloo = dist.new_group(backend="gloo")
    assert dist.get_backend() == "reduction"
    layout = appliance_group().layout
    emit(check="layout", ok=True, staged=layout is not None,
         hosts=[list(h) for h in layout.hosts] if layout else None)
    if config_from_env().deterministic:
        deterministic_checks(rank, world, gloo)
        dist.destroy_process_group()
        return
    n = 3000  # several segments
    for dname, dtype in DTYPES.items():
        for oname, op in OPS.items():
            t = inputs(rank, n, dtype)
            dist.all_reduce(t, op=op)
            ref = inputs(rank, n, dtype).float()
            dist.all_reduce(ref, op=dist.ReduceOp.SUM if oname == "avg" else op, group=gloo)
            if oname == "avg":
                ref /= world
            if oname == "avg":  # x/world may round differently: within the dtype's tolerance
                ok = torch.allclose(t.float(), ref, rtol=TOLERANCE[dtype], atol=0)
            else:  # integer-valued: exact
                ok = torch.equal(t, ref.to(dtype))
            emit(check="allreduce", dtype=dname, op=oname, ok=bool(ok))
    layouts(rank, gloo)
    # What a GPU job needs of the delegated collectives (no GPU here to run one): Gloo
    # behind CUDA tensors as behind CPU ones.
    delegate = appliance_group().gloo
    emit(check="cuda-delegated", ok=all(
        isinstance(delegate._get_backend(torch.device(d)), dist.ProcessGroupGloo)
        for d in ("cpu", "cuda")))
    # three outstanding async rounds
    ts = [inputs(rank, 5000, torch.float32, salt=s) for s in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    futs = [w.get_future() for w in works]
    for w in works:
        w.wait()
    ok = True
    for s, (t, f) in enumerate(zip(ts, futs, strict=True)):
        ref = inputs(rank, 5000, torch.float32, salt=s)
        dist.all_reduce(ref, group=gloo)
        ok = ok and torch.equal(t, ref) and torch.equal(f.value()[0], ref)
    emit(check="async", ok=bool(ok))
    dist.barrier()
    emit(check="barrier", ok=True)
    b = torch.full((7,), float(rank)) if rank == 1 else torch.zeros(7)
    dist.broadcast(b, src=1)
    emit(check="broadcast", ok=bool(torch.equal(b, torch.ones(7))))
    ints = torch.tensor([rank + 1, 2], dtype=torch.int64)
    dist.all_reduce(ints, op=dist.ReduceOp.PRODUCT)  # delegated to gloo
    emit(check="delegated-int", ok=ints.tolist() == [int(torch.arange(1, world + 1).prod()),
                                                       2 ** world])
    dist.destroy_process_group()


def layouts(rank: int, gloo: dist.ProcessGroup) -> None:
    """Tensors that are not one contiguous block (staged through a contiguous copy and written
    back: the path CUDA tensors share), and several tensors in one coalesced call: each ends
    equal to Gloo's result, and the memory around a strided view is left alone."""
    def gloo_sum(t: torch.Tensor) -> torch.Tensor:
        ref = t.clone()
        dist.all_reduce(ref, group=gloo)
        return ref

    base = inputs(rank, 2 * 3000, torch.float32, salt=7).view(3000, 2)
    column, other = base[:, 0], base[:, 1].clone()
    want = gloo_sum(column.contiguous())
    dist.all_reduce(column)
    emit(check="strided", ok=bool(not column.is_contiguous() and torch.equal(column, want)
                                  and torch.equal(base[:, 1], other)))
    flipped = inputs(rank, 40 * 70, torch.bfloat16, salt=8).view(40, 70).t()
    want = gloo_sum(flipped.contiguous())
    dist.all_reduce(flipped)
    emit(check="transposed", ok=bool(not flipped.is_contiguous() and torch.equal(flipped, want)))
    parts = [inputs(rank, n, dtype, salt=9) for n, dtype in
             ((3000, torch.float32), (17, torch.float16), (5000, torch.bfloat16))]
    wants = [gloo_sum(t) for t in parts]
    appliance_group().allreduce_coalesced(parts).wait()
    emit(check="coalesced", ok=all(torch.equal(t, w) for t, w in zip(parts, wants, strict=True)))
    weight = torch.nn.Parameter(inputs(rank, 30 * 20, torch.float32, salt=10).view(30, 20))
    want = gloo_sum(weight.detach().t().contiguous())
    dist.all_reduce(weight.t())  # a view of a leaf that requires grad, written as Gloo would
    emit(check="parameter", ok=bool(torch.equal(weight.detach().t(), want)))
    scalar = torch.tensor(float(rank + 1), dtype=torch.float16)  # 0-d
    dist.all_reduce(scalar)
    world = dist.get_world_size()
    emit(check="scalar", ok=scalar.dim() == 0 and scalar.item() == world * (world + 1) / 2)
    # A subgroup on the backend: its own job at the appliance, the other ranks not in it.
    members = [0, world - 1]
    sub = dist.new_group(ranks=members, backend="reduction")
    if rank in members:
        part = torch.full((2000,), float(rank + 1))
        dist.all_reduce(part, group=sub)
        emit(check="subgroup", ok=bool(torch.equal(part, torch.full((2000,), float(world + 1)))))
    else:
        emit(check="subgroup", ok=sub == dist.GroupMember.NON_GROUP_MEMBER)
    nothing = torch.empty(0, 3)
    dist.all_reduce(nothing)  # (it once waited for a result until the deadline, then raised)
    emit(check="empty", ok=nothing.shape == (0, 3))
    # Elements sharing memory: the write back once killed the pump thread, and this call
    # (its future never completed) and every later one waited forever.
    shared = torch.ones(1).expand(10)
    try:
        dist.all_reduce(shared)
        refused = ""
    except ReductionError as exc:
        refused = str(exc)
    after = torch.ones(5)
    dist.all_reduce(after)
    emit(check="overlapping", ok="share memory" in refused and "clone()" in refused
         and bool(torch.equal(after, torch.full((5,), float(world)))), refused=refused)


def overlap(rank: int, world: int, store: str) -> None:
    init("reduction", rank, world, store)
    gloo = dist.new_group(backend="gloo")
    pg = appliance_group()
    ts = [inputs(rank, 65536, torch.float32, salt=s) for s in range(8)]  # 256 KiB each
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    refs = [inputs(rank, 65536, torch.float32, salt=s) for s in range(8)]
    for ref in refs:
        dist.all_reduce(ref, group=gloo)
    ok = all(torch.equal(t, r) for t, r in zip(ts, refs, strict=True))
    # Large tensors are cut into up to one round per lane: the pieces land where they belong.
    for dtype, n in ((torch.float32, 1 << 20), (torch.bfloat16, (1 << 20) + 7)):
        t = inputs(rank, n, dtype, salt=5)
        ref = inputs(rank, n, dtype, salt=5).float()
        dist.all_reduce(t)
        dist.all_reduce(ref, group=gloo)
        ok = ok and torch.equal(t, ref.to(dtype))
    assert pg.client is not None  # a flat group: every rank has its own
    emit(check="overlap", ok=bool(ok), most_in_flight=pg.client.pipeline.most_in_flight,
         lanes=pg.client.pipeline.lanes, rounds=pg.client.pipeline.submitted,
         segment_bytes=pg.client.pipeline.segment_bytes,
         lane_window=pg.client.pipeline.lane_window)
    dist.destroy_process_group()


def stall(rank: int, world: int, store: str) -> None:
    init("reduction", rank, world, store)
    # Every rank stays in the job until all are done (the Gloo barrier below): the last rank
    # does not leave before the others have joined, so the job goes ACTIVE, which is what the
    # test waits for before it aborts the job.
    gloo = dist.new_group(backend="gloo")
    if rank < world - int(os.environ.get("STALLED_RANKS", "1")):
        t = torch.ones(100_000)
        began = time.monotonic()
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait()
            emit(check="stall", raised=None)
        except Exception as exc:
            emit(check="stall", raised=type(exc).__name__, message=str(exc),
                 seconds=time.monotonic() - began)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def loop(rank: int, world: int, store: str) -> None:
    """All_reduces until one fails (the test kills a rank meanwhile): says when the first
    is done, then how the failure came and after how long since the last success."""
    init("reduction", rank, world, store)
    t = torch.ones(200_000)
    calls, last = 0, time.monotonic()
    while True:
        try:
            dist.all_reduce(t)
        except Exception as exc:
            emit(check="loop", raised=type(exc).__name__, message=str(exc), calls=calls,
                 seconds=time.monotonic() - last)
            break
        last = time.monotonic()
        t.fill_(1.0)
        calls += 1
        if calls == 1:
            emit(check="looping")
    exit_without_finalizing(0)  # the group is broken: destroying it would wait on Gloo


def named(rank: int, world: int, store: str) -> None:
    """REDUCTION_JOB is set: every process group on the backend and every hook state is a job
    of its own (they once all claimed the one name: the second group's registration failed),
    and each reduces. Reports each one's job name and whether its sum was right."""
    init("reduction", rank, world, store)

    def reduced(group: dist.ProcessGroup | None, size: int) -> bool:
        t = torch.ones(3000)
        dist.all_reduce(t, group=group)
        return bool(torch.equal(t, torch.full((3000,), float(size))))

    emit(check="named-world", job=appliance_group().job, ok=reduced(None, world))
    edge = [0, world - 1]
    sub = dist.new_group(ranks=edge)  # on the backend too: the default group's
    if rank in edge:
        emit(check="named-sub", job=sub.job, ok=reduced(sub, 2))  # type: ignore[union-attr]
    every = dist.new_group()
    emit(check="named-every", job=every.job, ok=reduced(every, world))  # type: ignore[union-attr]
    states = [ApplianceHookState(), ApplianceHookState()]
    tail = [1, world - 1]
    gloo_tail = dist.new_group(ranks=tail, backend="gloo")
    if rank in tail:
        states.append(ApplianceHookState(group=gloo_tail))
    else:
        try:
            ApplianceHookState(group=gloo_tail)
            emit(check="named-outsider", ok=False)
        except ValueError as exc:
            emit(check="named-outsider", ok="not a member" in str(exc))
    for n, state in enumerate(states):
        t = torch.ones(3000)
        state.pump.submit([t], "sum").wait()
        size = world if n < 2 else len(tail)
        emit(check=f"named-hook{n}", job=state.job,
             ok=bool(torch.equal(t, torch.full((3000,), float(size)))))
        state.close()
    dist.destroy_process_group()


STAGED: list[bool] = []  # whether each hook state made reduced on the host first


def train(hooked: bool, rank: int, world: int) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if hooked:
        state = ApplianceHookState()
        STAGED.append(isinstance(state.pump, HostStage))
        ddp.register_comm_hook(state, appliance_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(20):
        x = torch.randn(16, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if state is not None:
        state.close()
    return losses, [p.detach().clone() for p in model.parameters()]


def ddp(rank: int, world: int, store: str) -> None:
    init("gloo", rank, world, store)
    hooked_losses, hooked_params = train(True, rank, world)
    plain_losses, plain_params = train(False, rank, world)
    flat = torch.cat([p.reshape(-1) for p in hooked_params])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    emit(check="ddp-identical", ok=all(torch.equal(g, gathered[0]) for g in gathered))
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(b))
                for a, b in zip(hooked_losses, plain_losses, strict=True))
    params_close = all(torch.allclose(a, b, atol=1e-5)
                       for a, b in zip(hooked_params, plain_params, strict=True))
    emit(check="ddp-vs-gloo", ok=bool(close and params_close), hooked=hooked_losses[-1],
         plain=plain_losses[-1], first=hooked_losses[0], staged=STAGED)
    dist.destroy_process_group()


CHECKPOINT_S = 4.0  # longer than the advised deadline of the appliance the test starts (2 s)


def patience(rank: int, world: int, store: str) -> None:
    init("reduction", rank, world, store)  # the group's timeout: 60 s
    if rank == 0:
        time.sleep(CHECKPOINT_S)  # the workload under test: rank 0 busy, the client not called
    t = torch.ones(10)
    dist.all_reduce(t)  # the others waited here, CHECKPOINT_S
    emit(check="backend-waits", ok=bool(torch.equal(t, torch.full((10,), float(world)))))
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2), process_group=gloo)
    state = ApplianceHookState(group=gloo)
    model.register_comm_hook(state, appliance_allreduce_hook)
    for step in range(3):  # buckets are rebuilt (a Gloo broadcast) in the second step
        if rank == 0 and step == 2:
            time.sleep(CHECKPOINT_S)  # the workload under test, as above
        model(torch.ones(4, 8)).sum().backward()  # the others' bucket waits in the hook
    emit(check="hook-waits", ok=bool(torch.isfinite(model.module.weight.grad).all()))
    state.close()
    dist.destroy_process_group()


def _two_trained_models(gloo: dist.ProcessGroup) -> tuple[
        torch.nn.Module, torch.nn.Module, ApplianceHookState]:
    """A DDP model on the backend and one through the hook (on `gloo`), two steps each: the
    buckets are rebuilt (a Gloo broadcast) in the second; then every rank at a barrier."""
    torch.manual_seed(0)
    on_backend = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    hooked = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2), process_group=gloo)
    state = ApplianceHookState(group=gloo)
    hooked.register_comm_hook(state, appliance_allreduce_hook)
    for _ in range(2):
        for model in (on_backend, hooked):
            model(torch.ones(4, 8)).sum().backward()
    dist.barrier(group=gloo)
    return on_backend, hooked, state


def _step_each(check: str, on_backend: torch.nn.Module, hooked: torch.nn.Module) -> None:
    """One more step of each model, saying for each whether (and how) it raised."""
    for name, model in (("backend", on_backend), ("hook", hooked)):
        try:
            model(torch.ones(4, 8)).sum().backward()
            emit(check=f"{check}-{name}", raised=None)
        except Exception as exc:
            emit(check=f"{check}-{name}", raised=type(exc).__name__, message=str(exc))


def stranded(rank: int, world: int, store: str) -> None:
    """Rank 1 stops after two DDP steps (its process group shut, as Ctrl-C's unwinding does);
    rank 0's next step, on the backend and through the hook, can never be reduced: backward()
    must raise the appliance's reason, not end the process (it once died of SIGSEGV)."""
    init("reduction", rank, world, store)
    on_backend, hooked, state = _two_trained_models(dist.new_group(backend="gloo"))
    if rank == world - 1:
        state.close()
        dist.destroy_process_group()
        return
    _step_each("stranded", on_backend, hooked)
    state.close()
    dist.destroy_process_group()


def crashed(rank: int, world: int, store: str) -> None:
    """The last rank's script raises after two DDP steps (its data loader failed), and its
    process exits without destroy_process_group or closing its hook state. Leaving both jobs
    as the interpreter exits, it lets rank 0's next step fail at once with RankLeft, on the
    backend and through the hook; rank 0 once waited out the liveness timeout for RankSilent."""
    init("reduction", rank, world, store)
    on_backend, hooked, _ = _two_trained_models(dist.new_group(backend="gloo"))
    if rank == world - 1:
        raise RuntimeError("the data loader failed")
    _step_each("crashed", on_backend, hooked)
    exit_without_finalizing(0)  # the groups are broken: destroying them would wait on Gloo


def killed(rank: int, world: int, store: str) -> None:
    """The last rank is SIGKILLed after two DDP steps (the OOM killer, a scheduler): it says
    nothing to anyone. Rank 0's next step fails with RankEnded, on the backend and through the
    hook, about a second later: the appliance reached the killed rank's port and its host said
    it is closed. It once waited out the liveness timeout for RankSilent."""
    init("reduction", rank, world, store)
    on_backend, hooked, _ = _two_trained_models(dist.new_group(backend="gloo"))
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    _step_each("killed", on_backend, hooked)
    emit(check="killed-took", seconds=round(time.monotonic() - started, 2))
    exit_without_finalizing(0)  # the groups are broken: destroying them would wait on Gloo


class _Bucket:
    """What the hooks read of DDP's GradBucket: its flat buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def compressed(rank: int, world: int, store: str) -> None:
    init("reduction", rank, world, store)
    gloo = dist.new_group(backend="gloo")
    rng = np.random.default_rng(3000 + rank)
    grads = torch.from_numpy(rng.standard_normal(20_000).astype(np.float32))
    everyone = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(everyone, grads, group=gloo)
    exact = torch.stack(everyone).double().mean(dim=0)
    want = reference([numpy_view(g.to(torch.bfloat16)) for g in everyone], Op.AVG)

    def error(t: torch.Tensor) -> float:
        return float((t.double() - exact).abs().mean())

    on_backend = grads.clone()
    compressed_allreduce_hook(torch.bfloat16, _Bucket(on_backend)).wait()
    state = ApplianceHookState(compress=torch.bfloat16)
    hooked = grads.clone()
    appliance_allreduce_hook(state, _Bucket(hooked)).wait()  # type: ignore[arg-type]
    state.close()
    ring = grads.to(torch.bfloat16).div_(world)  # torch's compress hooks over Gloo's ring
    dist.all_reduce(ring, group=gloo)
    for check, t in (("compressed-backend", on_backend), ("compressed-hook", hooked)):
        emit(check=check, ok=bool(same_bits(numpy_view(t.to(torch.bfloat16)), want))
             and error(t) < error(ring.float()), error=error(t), ring_error=error(ring.float()))
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, rank, world, store, local, ifname = sys.argv[1:7]
    os.environ["REDUCTION_LOCAL_ADDRESS"] = local
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    modes = {"backend": backend, "overlap": overlap, "stall": stall, "ddp": ddp, "named": named,
             "patience": patience, "stranded": stranded, "loop": loop, "crashed": crashed,
             "killed": killed, "compressed": compressed}
    modes[mode](int(rank), int(world), store)
    exit_without_finalizing(0)  # all printed; see plugin.torch_exit for why
