"""A worker the test steers through stdin, one command per line, for scenarios that need ranks
to pause, die and come back:

    run N SIZE      N allreduces (sum) of SIZE bytes of fp32; one JSON line with the outcome
    compute S       be busy for S seconds without touching the client (a long forward pass)
    quit            leave the job and exit

Inputs depend on the rank and the size only, so any allreduce of one rank pairs with any of the
others and the reference is known: every result is checked bit for bit. An allreduce that fails
is reported (class and message) and the worker goes on with the next command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import leave, register
from reduction_appliance.plugin.rtt import Timing


def inputs(rank: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * (rank + 3)) % 11 - 5).astype(np.float32)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--appliance", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local", default="0.0.0.0")
    p.add_argument("--rejoin", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--unicast", action="store_true")
    p.add_argument("--deadline", type=float, default=20.0)
    args = p.parse_args()
    try:
        job = register(args.appliance, args.job, args.world, secret=args.secret,
                       deterministic=args.deterministic, multicast=not args.unicast)
        client = ApplianceClient([job], args.rank, local_address=args.local,
                                 timing=Timing(deadline=args.deadline), rejoin=args.rejoin)
    except ReductionError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 3
    core = client.jobs[0].cores[0]
    print(json.dumps({"joined": args.rank, "epoch": client.pipeline.epoch,
                      "job_id": client.jobs[0].job_id, "cookie": client.jobs[0].cookie,
                      "source": client.transport.source_for((core.host, core.port)),
                      "multicast": client.jobs[0].multicast}), flush=True)
    with client:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            if words[0] == "resync":  # what a caller does after an outage (plugin/silence.py)
                client.resync()
                print(json.dumps({"resynced": client.pipeline.epoch}), flush=True)
                continue
            if words[0] == "compute":
                time.sleep(float(words[1]))  # the workload: the client is not called meanwhile
                print(json.dumps({"computed": float(words[1])}), flush=True)
                continue
            count, size = int(words[1]), int(words[2])
            n = size // 4
            want = sum(inputs(r, n) for r in range(args.world)).astype(np.float32)
            mine = inputs(args.rank, n)
            ok = errors = 0
            failures: list[str] = []
            first_failure: float | None = None  # CLOCK_MONOTONIC: the test's clock too
            times: list[float] = []
            repairs_before = client.repairs
            for _ in range(count):
                work = mine.copy()
                start = time.perf_counter()
                try:
                    client.allreduce(work)
                except ReductionError as exc:
                    errors += 1
                    first_failure = first_failure or time.monotonic()
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                times.append(time.perf_counter() - start)
                ok += int(work.tobytes() == want.tobytes())
            print(json.dumps({"ran": count, "exact": ok, "errors": errors,
                              "failures": failures[-3:], "times": times,
                              "first_failure": first_failure,
                              "rejected": client.pipeline.rejected,
                              # this command's retransmissions, by the sign that sent each
                              "repairs": {name: after - before for name, after, before in zip(
                                  client.repairs._fields, client.repairs, repairs_before,
                                  strict=True)},
                              "epoch": client.pipeline.epoch}), flush=True)
        leave(client.jobs[0], args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
