"""A rank under torchrun with restarts: the "reduction" backend, twenty exact all_reduces, and
in the first attempt rank 1 dies after six (tests/plugin/test_torch.py runs it).

torchrun's static rendezvous keeps one c10d store across restarts, so the second attempt
meets what the first wrote there (Gloo's addresses, the job's name and secret); and with
REDUCTION_JOB set, the first attempt's job still holds the name. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import reduction_appliance.plugin.torch_backend  # noqa: F401  (registers "reduction")
from reduction_appliance.plugin.torch_exit import exit_without_finalizing

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("reduction")
    job = dist.distributed_c10d._get_default_group().job  # type: ignore[attr-defined]
    exact = 0
    for i in range(20):
        t = torch.full((3000,), float(rank + 1))
        dist.all_reduce(t)
        exact += bool(torch.equal(t, torch.full((3000,), 3.0)))
        if attempt == 0 and rank == 1 and i == 5:
            sys.stdout.flush()
            os._exit(1)  # dies without leaving: torchrun restarts both ranks
    # One write, under PIPE_BUF: the ranks share torchrun's stdout, and a line written in
    # pieces (print writes the newline apart) can interleave with the other rank's.
    line = json.dumps({"rank": rank, "attempt": attempt, "job": job, "exact": exact}) + "\n"
    sys.stdout.flush()
    os.write(1, line.encode())
    dist.destroy_process_group()
    exit_without_finalizing(0)
