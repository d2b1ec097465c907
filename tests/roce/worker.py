"""One rank of a RoCE job, as a process: register (transport roce), connect, join, allreduce
`--rounds` times, save the results for the test (tests/roce/test_daemon.py, which forks each
rank from a server that has imported this module: tests/roce/ranks.py).

    python -m tests.roce.worker --api H:P --name JOB --secret S --rank R --world N --ip A
        --elements N --dtype fp32 --op sum [--deterministic] [--exit-after-join] --out DIR
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import leave, register

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
# The product gives a leave 5 s (a training process should not wait long to exit). The emulated
# guest, busy beside the host's tests in a CI run, once took longer than that to answer one: a
# rank of the two-jobs-at-once test whose 16 MiB were reduced and exact failed on its leave.
LEAVE_S = 60.0


def inputs(rank: int, elements: int, dtype: str, deterministic: bool, round_no: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + round_no)
    if deterministic:  # any floats: rank order makes the sum bitwise reproducible
        return rng.standard_normal(elements).astype(DTYPES[dtype])
    return rng.integers(-64, 64, elements).astype(DTYPES[dtype])  # exact in any order


def reference(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """What the appliance must answer: folded in fp32 in rank order, narrowed at the end."""
    acc = arrays[0].astype(np.float32)
    for a in arrays[1:]:
        b = a.astype(np.float32)
        acc = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum}[op](acc, b)
    if op == "avg":
        acc = np.divide(acc, np.float32(len(arrays)))
    return acc.astype(arrays[0].dtype)


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--api", "--name", "--secret", "--ip", "--dtype", "--op", "--out"):
        p.add_argument(name, required=True)
    for name in ("--rank", "--world", "--elements"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--multicast", action="store_true", help="results as UD multicast")
    p.add_argument("--exit-after-join", action="store_true")
    p.add_argument("--hold", action="store_true",
                   help="stay joined (heartbeating) until stdin closes: after the join with "
                        "--exit-after-join, else after the rounds")
    p.add_argument("--stay", action="store_true", help="do not leave the job at the end")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    info = register(a.api, a.name, a.world, secret=a.secret, deterministic=a.deterministic,
                    multicast=True if a.multicast else None, transport="roce")
    out = Path(a.out)
    try:
        with ApplianceClient([info], a.rank, local_address=a.ip) as client:
            (out / f"joined-{a.rank}").write_text(repr(client.jobs[0].cookie))
            if a.exit_after_join:
                if a.hold:  # alive and heartbeating until the test has looked
                    sys.stdin.read()
                os._exit(0)  # gone without a word: no leave, no heartbeat from now on
            for r in range(a.rounds):
                x = inputs(a.rank, a.elements, a.dtype, a.deterministic, r)
                client.allreduce(x, a.op)
                np.save(out / f"result-{a.rank}-{r}.npy", x.view(np.uint8))
            if a.hold:  # alive and heartbeating, its queue pairs up, until the test has looked
                sys.stdin.read()
            if not a.stay:
                # The last rank's leave ends the job: its queue pairs go.
                leave(client.jobs[0], a.rank, LEAVE_S)
    except ReductionError as exc:
        (out / f"error-{a.rank}").write_text(f"{type(exc).__name__}: {exc}")
        print(f"rank {a.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
