"""One worker of the peer run: Gloo ring allreduce via torch.distributed, same cases, same checks.

    python -m reduction_appliance.bench.gloo_worker --master 198.18.0.101:29500 --world 4 \\
        --rank 0 --ifname w0 --sizes 64MiB --dtypes fp32 --ops sum

The counterpart of the lab's worker program (deploy.testnet.worker) for the comparison in
bench.allreduce: the same case options, the same inputs (deploy.testnet.worker.inputs,
integer-valued so sums are exact in any order), the same numpy reference, and the same JSON
line per case (rank, size, dtype, op, times, checked, ok).

Timing policy, identical to the lab worker's: no barrier; each rank copies its input into the
work tensor (untimed), then times one allreduce call, back to back. The untimed warmup
iterations line the ranks up; the driver takes the slowest rank per iteration, so rank skew
shows up in both systems the same way. (`--barrier` adds a barrier before each timed iteration,
for experiments only: the lab worker has no such option, so the comparison never uses it.)

AVG is computed as Gloo SUM followed by an fp32 divide, exactly as the reference does (Gloo has
no ReduceOp.AVG). A dtype/op Gloo rejects is reported as a skipped case, not as a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from reduction_appliance.dataplane.wire import DType, Op
from reduction_appliance.deploy.testnet.reference import reference, same_bits
from reduction_appliance.deploy.testnet.worker import (
    add_probe_arguments,
    case_arguments,
    inputs,
    probe_of,
)
from reduction_appliance.plugin.torch_exit import exit_without_finalizing

__all__ = ["main"]

_TORCH_OPS = {
    Op.SUM: dist.ReduceOp.SUM,
    Op.AVG: dist.ReduceOp.SUM,  # then divided by the world size in fp32, like the reference
    Op.MIN: dist.ReduceOp.MIN,
    Op.MAX: dist.ReduceOp.MAX,
}


def to_torch(array: np.ndarray, dtype: DType) -> torch.Tensor:
    """A torch tensor over the same bits (bf16: numpy holds ml_dtypes.bfloat16 -> uint16 view)."""
    if dtype is DType.BFLOAT16:
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def to_numpy(tensor: torch.Tensor, like: np.ndarray) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(like.dtype)
    return tensor.numpy()


def _finish(work: torch.Tensor, op: Op, world: int) -> None:
    """AVG: the summed tensor divided by the world in fp32 and narrowed, as the reference does."""
    if op is Op.AVG:
        work.copy_((work.float() / float(world)).to(work.dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.gloo_worker",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--master", required=True, help="rank 0's HOST:PORT for the TCP rendezvous")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--ifname", default=None, help="GLOO_SOCKET_IFNAME: this worker's interface")
    case_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per collective")
    p.add_argument("--barrier", action="store_true",
                   help="barrier before each timed iteration (not used by bench.allreduce)")
    add_probe_arguments(p)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", world_size=args.world,
                            rank=args.rank, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        case = 0
        for dtype in args.dtypes:
            for size in args.sizes:
                for op in args.ops:
                    case += 1
                    print(json.dumps(_run_case(args, case, dtype, size, op)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def _run_case(args: argparse.Namespace, case: int, dtype: DType, size: int,
              op: Op) -> dict[str, Any]:
    itemsize = dtype.itemsize
    n = max(1, size // itemsize)
    # deterministic=False: integer-valued inputs, exact in Gloo's own summation order.
    mine = inputs(args.seed, case, args.rank, n, dtype, deterministic=False)
    row: dict[str, Any] = {
        "rank": args.rank, "size": n * itemsize, "dtype": dtype.name.lower(),
        "op": op.name.lower(), "times": [], "checked": False, "ok": True, "bad_iterations": 0,
        "numpy_dtype": str(mine.dtype), "system": "gloo",
    }
    want = None
    if not args.no_check:
        want = reference([
            mine if r == args.rank else inputs(args.seed, case, r, n, dtype, deterministic=False)
            for r in range(args.world)
        ], op)
    source = to_torch(mine, dtype)
    work = torch.empty_like(source)
    times: list[float] = []
    bad = 0
    probe = probe_of(args)
    for i in range(args.warmup + args.iters):
        work.copy_(source)
        timed = i >= args.warmup
        if args.barrier and timed:
            dist.barrier()
        if timed:
            probe.before()
        start = time.perf_counter()
        try:
            dist.all_reduce(work, op=_TORCH_OPS[op])
        except (RuntimeError, ValueError) as exc:
            # Gloo checks the dtype/op before any communication, identically on every rank,
            # so every rank skips together and the group stays usable.
            if i == 0:
                row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                return row
            raise
        _finish(work, op, args.world)  # AVG's divide is part of what a Gloo user pays
        elapsed = time.perf_counter() - start
        if timed:
            probe.after(elapsed)
            times.append(elapsed)
        if want is not None and not same_bits(to_numpy(work, want), want):
            bad += 1
    row.update(times=times, checked=want is not None, ok=bad == 0, bad_iterations=bad,
               **probe.report())
    return row


if __name__ == "__main__":
    # Gloo's threads may abort an interpreter that finalizes: see plugin.torch_exit.
    exit_without_finalizing(main())
