"""One rank of bench.hosts: times torch's all_reduce on one process group and checks it.

    python -m reduction_appliance.bench.hosts_worker --backend reduction --hierarchy auto \\
        --store 198.18.0.101:29700 --world 8 --rank 0 --local 198.18.0.101 --ifname w0 \\
        --appliance 198.18.0.1:7000 --size 64MiB --iters 5 --warmup 2

Prints one JSON line: rank, times (seconds, one per timed call), ok (every result exact),
staged (whether this rank's group reduced on its host first). Inputs are small integers, so
every sum is exact in fp32 whatever the order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

from reduction_appliance.dataplane.units import parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reduction_appliance.bench.hosts_worker")
    p.add_argument("--backend", choices=("gloo", "reduction"), required=True)
    p.add_argument("--hierarchy", default="auto")
    p.add_argument("--store", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local", required=True)
    p.add_argument("--ifname", required=True)
    p.add_argument("--appliance", default="")
    p.add_argument("--size", type=parse_size, required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.update(REDUCTION_APPLIANCE=args.appliance, REDUCTION_LOCAL_ADDRESS=args.local,
                      REDUCTION_HIERARCHY=args.hierarchy, GLOO_SOCKET_IFNAME=args.ifname)
    import torch
    import torch.distributed as dist

    from reduction_appliance.plugin.torch_backend import ApplianceProcessGroup
    from reduction_appliance.plugin.torch_exit import exit_without_finalizing

    dist.init_process_group(args.backend, init_method=f"tcp://{args.store}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=300))
    n = args.size // 4
    pattern = torch.arange(n, dtype=torch.float32).remainder_(1000)
    want = pattern * args.world + args.world * (args.world - 1) / 2
    work = torch.empty(n, dtype=torch.float32)
    times, ok = [], True
    for i in range(args.warmup + args.iters):
        torch.add(pattern, args.rank, out=work)  # untimed
        began = time.perf_counter()
        dist.all_reduce(work)
        if i >= args.warmup:
            times.append(time.perf_counter() - began)
        ok = ok and bool(torch.equal(work, want))
    group = dist.distributed_c10d._get_default_group()
    staged = isinstance(group, ApplianceProcessGroup) and group.layout is not None
    print(json.dumps({"rank": args.rank, "times": times, "ok": ok, "staged": staged}),
          flush=True)
    dist.destroy_process_group()
    exit_without_finalizing(0)


if __name__ == "__main__":
    sys.exit(main())
