"""Integration tests on real network namespaces: skipped unless we may create them."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # plain `pytest` (not `python -m pytest`) without an install
    sys.path.insert(0, str(_ROOT))

from reduction_appliance.deploy.testnet import Lab, Topology, leftovers, unique_prefix  # noqa: E402

_HERE = Path(__file__).resolve().parent


@functools.cache
def _missing_capability() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN to create network namespaces, CAP_NET_ADMIN for links)"
    if shutil.which("ip") is None:
        return "needs the ip tool (iproute2) to run commands inside namespaces"
    try:
        from pyroute2 import netns
    except ImportError as exc:
        return f"needs pyroute2: {exc}"
    probe = unique_prefix() + "-probe"
    try:
        netns.create(probe)
    except Exception as exc:
        return f"cannot create network namespaces (needs CAP_SYS_ADMIN and CONFIG_NET_NS): {exc}"
    with contextlib.suppress(Exception):
        netns.remove(probe)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.netns)
        reason = _missing_capability()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def lab() -> Iterator[Callable[[Topology], Lab]]:
    """Factory: ``lab(Topology.rack(...))`` builds a running Lab, torn down after the test,
    which then fails if anything with the lab's prefix is left behind."""
    with contextlib.ExitStack() as stack:
        built: list[Lab] = []

        def make(topology: Topology) -> Lab:
            running = stack.enter_context(Lab(topology))
            built.append(running)
            return running

        yield make
    for done in built:
        assert leftovers(done.topology.name_prefix) == []
