"""The torch backend over RoCE: examples/train_ddp.py on 2 ranks (rxe2, rxe3) with the
"reduction" backend in deterministic mode, once over UDP and once over RoCE against the same
reductiond; the trained parameters must be bitwise the same."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.roce.daemon import START_S, Appliance

pytest.importorskip("torch", reason="the example trains with torch")

OPTIONS = ["--comm", "reduction", "--deterministic", "--steps", "6", "--warmup", "2",
           "--batch", "16", "--hidden", "64", "--layers", "2", "--shard", "256",
           "--bucket-mb", "0.05", "--seed", "5", "--json", "--timeout", "300"]


def test_ddp_over_roce_ends_bitwise_where_udp_does(roce_appliance: Appliance) -> None:
    procs = [subprocess.Popen([sys.executable, "-m", "tests.roce.ddp_twice", str(rank),
                               roce_appliance.api, *OPTIONS],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    runs = []
    for p in procs:
        out, err = p.communicate(timeout=3 * START_S)
        assert p.returncode == 0, err[-3000:]
        runs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    assert all(len(r) == 2 for r in runs), runs
    udp = {r[0]["params_sha256"] for r in runs}
    roce = {r[1]["params_sha256"] for r in runs}
    assert len(udp) == 1 and udp == roce, (udp, roce)
    # The runs really trained (a frozen model would match itself too).
    assert all(r[0]["final_loss"] != r[0]["first_loss"] for r in runs)
