"""The torch backend over RoCE: examples/train_ddp.py on 2 ranks (rxe2, rxe3) with the
"reduction" backend in deterministic mode, once over UDP and once over RoCE against the same
reductiond; the trained parameters must be bitwise the same."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.roce.daemon import START_S, Appliance
from tests.roce.ddp_twice import Zygote

# Not imported here: torch takes 90 s to import in the guest, and only the ranks need it.
if importlib.util.find_spec("torch") is None:
    pytest.skip("the example trains with torch, which is not installed", allow_module_level=True)

OPTIONS = ["--comm", "reduction", "--deterministic", "--steps", "6", "--warmup", "2",
           "--batch", "16", "--hidden", "64", "--layers", "2", "--shard", "256",
           "--bucket-mb", "0.05", "--seed", "5", "--json", "--timeout", "300"]


def test_ddp_over_roce_ends_bitwise_where_udp_does(roce_appliance: Appliance,
                                                   ddp_zygote: Zygote | None,
                                                   tmp_path: Path) -> None:
    assert ddp_zygote is not None  # started by tests/roce/conftest.py wherever this test runs
    # Room for the zygote's imports too, if the test came before they were done.
    ranks = ddp_zygote.run([[str(rank), roce_appliance.api, *OPTIONS] for rank in range(2)],
                           tmp_path, timeout=4 * START_S)
    runs = []
    for status, out, err in ranks:
        assert status == 0, err[-3000:]
        runs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    assert all(len(r) == 2 for r in runs), runs
    udp = {r[0]["params_sha256"] for r in runs}
    roce = {r[1]["params_sha256"] for r in runs}
    assert len(udp) == 1 and udp == roce, (udp, roce)
    # The runs really trained (a frozen model would match itself too).
    assert all(r[0]["final_loss"] != r[0]["first_loss"] for r in runs)
