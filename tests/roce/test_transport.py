"""The RoCE transports end to end on soft-RoCE: the real core loop and aggregator behind
`RoceCoreTransport` (rxe1), real clients behind `RoceWorkerTransport` (rxe2..), results checked
exactly against numpy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing import Pipe
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.loop import CoreLoop
from reduction_appliance.dataplane.registration import EndpointInfo
from reduction_appliance.dataplane.roce import ROCE_GROUP_PORT, RoceCoreTransport
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import AddJob, CoreConfig, JobSpec, Request
from reduction_appliance.dataplane.verbs import RoceDevice
from reduction_appliance.dataplane.wire import HEADER_SIZE, DType, Header, Kind, Op, pack_into
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import JobInfo
from reduction_appliance.plugin.roce import RoceWorkerTransport
from reduction_appliance.plugin.rtt import Timing
from tests.roce.loss import multicast_loss
from tests.roce.worker import reference

CORE = ("10.77.0.1", 7000)  # the core's identity for the clients (its UDP address elsewhere)
SEGMENT = 64 * 1024
SLOTS = 8  # slot pairs per job on the core: the landing entries of each worker
GROUP = ("239.255.77.1", ROCE_GROUP_PORT)  # a RoCE job's multicast group, as the registry names it
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
# The guest emulates its CPU (Python runs 20-50x slower there): generous timers, no retries.
TIMING = Timing(rto_initial=5.0, rto_min=5.0, rto_max=10.0, deadline=120.0)


@dataclass
class Rig:
    loop: CoreLoop
    core: RoceCoreTransport
    clients: dict[int, list[ApplianceClient]]  # job -> clients by rank
    workers: list[RoceWorkerTransport]

    def run(self, job: int, arrays: list[Any], op: str, timeout: float = 120.0) -> None:
        self.run_jobs({job: (arrays, op)}, timeout)

    def run_jobs(self, work: dict[int, tuple[list[Any], str]], timeout: float = 120.0) -> None:
        """Start every rank's allreduce of every job, then turn the core and the clients until
        all rounds end; any round's error is raised."""
        pending = {(job, r): self.clients[job][r].start(a, op)
                   for job, (arrays, op) in work.items() for r, a in enumerate(arrays)}
        give_up = time.monotonic() + timeout
        while pending:
            assert time.monotonic() < give_up, f"rounds still open: {sorted(pending)}"
            while self.loop.receive_burst():
                pass
            for job in work:
                for r, client in enumerate(self.clients[job]):
                    for outcome in client.progress(timeout=0):
                        if outcome.error is not None:
                            raise outcome.error
                        assert pending.pop((job, r)) == outcome.ticket


@contextmanager
def rig(world: int, jobs: dict[int, bool], *, segment: int = SEGMENT, multicast: bool = False,
        timing: Timing = TIMING) -> Iterator[Rig]:
    """A core on rxe1 and `world` workers on rxe2.. (each with one client per job: job id ->
    deterministic), connected queue pair by queue pair as the control plane would; with
    `multicast`, results go to a group as UD chunks (each worker joins it)."""
    with ExitStack() as stack:
        ours, theirs = Pipe()
        stack.callback(ours.close)
        stack.callback(theirs.close)
        cfg = CoreConfig(index=0, cpu=None, bind=CORE, max_payload=segment, slot_capacity=64,
                         rx_buffers=256, kernels="numpy")
        arena = SlotArena(cfg.slot_capacity, cfg.max_payload, cfg.rx_buffers)
        device = stack.enter_context(RoceDevice("rxe1"))
        counters = Counters()
        core = RoceCoreTransport(device, arena, counters, peers=16)
        loop = CoreLoop(cfg, theirs, counters, core, arena=arena)
        stack.callback(loop.close)
        workers: list[RoceWorkerTransport] = []
        devices = [stack.enter_context(RoceDevice(f"rxe{2 + r % 3}")) for r in range(world)]

        def connected(r: int) -> RoceWorkerTransport:
            # A client owns its transport, hence its queue pair (like its UDP socket): the
            # completions it polls are its own.
            worker = RoceWorkerTransport(devices[r], f"10.77.0.{2 + r % 3}",
                                         HEADER_SIZE + segment)
            stack.callback(worker.close)
            address = (f"10.77.0.{2 + r % 3}", len(workers) + 1)  # as the control plane would
            core_end = core.accept(worker.open(CORE, SLOTS), address)
            worker.connect(CORE, core_end, address)
            if multicast:
                worker.join_multicast(GROUP[0], {core_end.multicast_qpn: (CORE, SLOTS)},
                                      core_end.mtu)
            workers.append(worker)
            return worker

        clients: dict[int, list[ApplianceClient]] = {}
        for n, (job, deterministic) in enumerate(jobs.items()):
            cookie = 0xC0FFEE + job
            transports = [connected(r) for r in range(world)]
            spec = JobSpec(job, cookie, world, SLOTS, deterministic=deterministic,
                           multicast=GROUP if multicast else None,
                           endpoints=tuple(t.source_for(CORE) for t in transports),
                           hold_buffers=64 if deterministic else 0)
            assert loop.serve(Request(n + 1, AddJob(spec))).error is None
            info = JobInfo("roce", job, f"job{job}", world, segment,
                           GROUP if multicast else None, deterministic, timing.deadline,
                           (EndpointInfo(0, *CORE, SLOTS),), cookie=cookie)
            clients[job] = [ApplianceClient([info], r, timing=timing, transport=transports[r],
                                            lease=False) for r in range(world)]
            for client in clients[job]:  # closes its transport: the rig closes it again
                stack.callback(client.close)
        yield Rig(loop, core, clients, workers)


def integers(world: int, n: int, dtype: Any, seed: int) -> list[Any]:
    """Small integers: every sum is exact in any order and in every dtype."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-64, 64, n).astype(dtype) for _ in range(world)]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_and_op_is_exact(dtype: str) -> None:
    world = 3
    with rig(world, {1: False}) as r:
        for op in ("sum", "avg", "min", "max"):
            for n in (1024, 100_003):  # 4 KiB of fp32; several segments with a short tail
                arrays = integers(world, n, DTYPES[dtype], seed=n)
                want = reference(arrays, op)
                r.run(1, arrays, op)
                for a in arrays:
                    assert np.array_equal(a.view(np.uint8), want.view(np.uint8)), (op, n)
        k = r.loop.counters
        assert k[Counter.ROCE_PEERS_LOST] == 0
        assert k[Counter.ROCE_POST_SEND] == k[Counter.PACKETS_OUT]
        # Results over 4 KiB were RDMA-written into landing entries; nothing was refused.
        assert k[Counter.ROCE_RESULT_WRITES] > 0
        assert k[Counter.ROCE_DROP_IMMEDIATE] == k[Counter.ROCE_UNSENDABLE] == 0


def test_sixteen_mebibytes_in_quarter_mebibyte_segments() -> None:
    world = 2
    with rig(world, {1: False}, segment=256 * 1024) as r:
        arrays = integers(world, 4 * 1024 * 1024, np.float32, seed=7)
        want = reference(arrays, "sum")
        r.run(1, arrays, "sum", timeout=300.0)
        for a in arrays:
            assert np.array_equal(a, want)
        segments = 16 * 1024 * 1024 // (256 * 1024)
        assert r.loop.counters[Counter.SEGMENTS_REDUCED] == segments
        # One message per contribution and per result: nothing lost, nothing retransmitted.
        assert r.loop.counters[Counter.PACKETS_IN] == world * segments
        assert all(c.retransmissions == 0 for c in r.clients[1])
        # Each result was written into its slot's landing entry, reused 8 times per worker.
        assert r.loop.counters[Counter.ROCE_RESULT_WRITES] == world * segments


def test_deterministic_mode_is_bitwise_rank_order() -> None:
    world = 3
    with rig(world, {2: True}) as r:
        rng = np.random.default_rng(3)
        arrays = [rng.standard_normal(50_000).astype(np.float32) for _ in range(world)]
        want = reference(arrays, "sum")  # folded in rank order, as deterministic mode promises
        r.run(2, arrays, "sum")
        for a in arrays:
            assert np.array_equal(a.view(np.uint32), want.view(np.uint32))


def test_two_jobs_at_once_share_the_core() -> None:
    world = 2
    with rig(world, {3: False, 4: False}) as r:
        a3 = integers(world, 40_000, np.float32, seed=3)
        a4 = integers(world, 30_000, np.float16, seed=4)
        w3, w4 = reference(a3, "sum"), reference(a4, "max")
        r.run_jobs({3: (a3, "sum"), 4: (a4, "max")})
        assert all(np.array_equal(a, w3) for a in a3)
        assert all(np.array_equal(a, w4) for a in a4)


def test_a_contribution_whose_immediate_names_another_slot_is_dropped_and_counted() -> None:
    """A peer's fault: the core drops it before the aggregator sees it; the job carries on."""
    world = 2
    with rig(world, {6: False}) as r:
        worker = r.workers[0]  # playing a broken worker: a valid contribution, a wrong immediate
        core = worker._cores[CORE]
        entry = worker._staging_entry(core)
        assert entry is not None
        pack_into(worker._staging.views[entry], Header(
            Kind.CONTRIBUTION, DType.FLOAT32, Op.SUM, 0, 6, 0, 0xC0FFEE + 6, 0, 0, 0, 64, 1))
        worker._post(core, HEADER_SIZE + 64, slot=3)
        give_up = time.monotonic() + 60.0
        while r.loop.counters[Counter.ROCE_DROP_IMMEDIATE] == 0:
            assert time.monotonic() < give_up, "the core never took the message"
            r.loop.receive_burst()
        assert r.loop.counters[Counter.PACKETS_IN] == 0  # the aggregator never saw it
        arrays = integers(world, 1000, np.float32, seed=6)
        want = reference(arrays, "sum")
        r.run(6, arrays, "sum")
        assert all(np.array_equal(a, want) for a in arrays)
        assert r.loop.counters[Counter.ROCE_DROP_IMMEDIATE] == 1


def test_a_stopped_appliance_is_an_error_for_its_workers_not_a_hang() -> None:
    world = 2
    with rig(world, {5: False}) as r:
        r.run(5, integers(world, 1000, np.float32, seed=5), "sum")
        r.core.close_peers()  # the appliance's queue pairs are gone (its process died)
        client = r.clients[5][0]
        client.start(np.ones(1000, np.float32))
        give_up = time.monotonic() + 60.0
        with pytest.raises(ReductionError, match="lost the RoCE connection"):
            while time.monotonic() < give_up:
                for outcome in client.progress(timeout=0.1):
                    if outcome.error is not None:
                        raise outcome.error


def test_multicast_results_are_exact_and_sent_once() -> None:
    world = 3
    with rig(world, {8: False}, multicast=True) as r:
        for dtype, op, n in ((np.float32, "sum", 100_003), (np.float16, "max", 40_000)):
            arrays = integers(world, n, dtype, seed=n)
            want = reference(arrays, op)
            r.run(8, arrays, op)
            assert all(np.array_equal(a.view(np.uint8), want.view(np.uint8)) for a in arrays)
        k = r.loop.counters
        # Each result went out once, as chunks, whatever the number of workers.
        assert k[Counter.ROCE_MULTICAST_CHUNKS] > 0
        assert k[Counter.ROCE_RESULT_WRITES] == 0
        assert all(w.multicast is not None and w.multicast.results > 0 for w in r.workers)


def test_multicast_chunks_lost_in_the_network_are_repaired_exactly() -> None:
    world = 2
    quick = Timing(rto_initial=1.0, rto_min=1.0, rto_max=4.0, deadline=120.0)
    # 8 segments of 17 chunks each: every 25th chunk lost on each worker's link leaves some
    # results whole and costs others a chunk or two.
    with multicast_loss(every=25), rig(world, {9: False}, multicast=True, timing=quick) as r:
        arrays = integers(world, 8 * SEGMENT // 4, np.float32, seed=9)
        want = reference(arrays, "sum")
        r.run(9, arrays, "sum")
        assert all(np.array_equal(a, want) for a in arrays)
        for worker, client in zip(r.workers, r.clients[9], strict=True):
            assert worker.multicast is not None
            assert worker.multicast.chunks_in < r.loop.counters[Counter.ROCE_MULTICAST_CHUNKS]
            assert worker.multicast.results > 0  # whole from multicast
            assert client.retransmissions > 0  # the rest asked for again...
        assert r.loop.counters[Counter.ROCE_RESULT_WRITES] > 0  # ...and written to them whole
