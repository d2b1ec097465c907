"""RoCE tests need real RDMA devices: rxe1..rxe4 on 10.77.0.1..4, as deploy/roce/guest.sh builds
them inside its guest (scripts/test runs this folder there). Anywhere else every test here
skips, naming what is missing."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from reduction_appliance.dataplane.verbs import roce_unavailable
from tests.roce.daemon import Appliance, appliance
from tests.roce.ddp_twice import Zygote

DEVICES = ("rxe1", "rxe2", "rxe3", "rxe4")


def _why_not() -> str | None:
    # scripts/test says why its guest could not run (e.g. no QEMU), so the skip names the cause.
    lab = os.environ.get("ROCE_LAB_UNAVAILABLE")
    if lab:
        return f"no soft-RoCE lab on this machine: {lab}"
    for device in DEVICES:
        why = roce_unavailable(device)
        if why is not None:
            return f"{why}; run inside the soft-RoCE guest: bash deploy/roce/guest.sh run " \
                   "--rxe 4 -- .venv/bin/python -m pytest tests/roce"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _why_not()
    if why is None:
        return
    mark = pytest.mark.skip(reason=why)
    for item in items:
        if "tests/roce/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(mark)


@pytest.fixture(scope="session")
def roce_appliance() -> Iterator[Appliance]:
    """One reductiond with RoCE for every test that does not stop it (starting one takes tens
    of seconds in the emulated guest)."""
    with appliance() as a:
        yield a


@pytest.fixture(scope="session", autouse=True)
def ddp_zygote(request: pytest.FixtureRequest) -> Iterator[Zygote | None]:
    """The DDP test's zygote (tests/roce/ddp_twice.py), started with the session so that torch's
    minutes of start-up in the guest overlap the other tests; None where that test will not run
    (not selected, no lab, no torch)."""
    wanted = any(item.nodeid.startswith("tests/roce/test_torch.py")
                 for item in request.session.items)
    if not wanted or _why_not() is not None or importlib.util.find_spec("torch") is None:
        yield None
        return
    zygote = Zygote()
    try:
        yield zygote
    finally:
        zygote.close()
