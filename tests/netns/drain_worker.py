"""A rank that reduces without pause until a call fails, for tests/netns/test_drain.py.

argv: API, job, world, rank, local address, join secret, elements. Prints READY after its
third exact call, then, at the failure, one JSON line: the calls that completed, the error's
class and text, and whether the failed call's tensor still holds this rank's input."""

from __future__ import annotations

import json
import sys

import numpy as np

from reduction_appliance.client import ApplianceClient, register
from reduction_appliance.dataplane.errors import ReductionError


def main() -> None:
    api, job, world, rank, local, secret, elements = sys.argv[1:8]
    size, n = int(world), int(elements)
    me = int(rank)
    info = register(api, job, world_size=size, secret=secret)
    base = np.arange(n, dtype=np.float32)
    summed = size * base + size * (size - 1) / 2
    calls = 0
    with ApplianceClient([info], me, local_address=local) as client:
        while True:
            x = base + me
            try:
                client.allreduce(x)
            except ReductionError as exc:
                print(json.dumps({"calls": calls, "error": type(exc).__name__,
                                  "message": str(exc),
                                  "intact": bool(np.array_equal(x, base + me))}), flush=True)
                return
            if not np.array_equal(x, summed):
                raise AssertionError(f"rank {me}: call {calls + 1} inexact")
            calls += 1
            if calls == 3:
                print("READY", flush=True)


if __name__ == "__main__":
    main()
