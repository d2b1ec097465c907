"""What the cores' fork server imports before it forks them (control/supervisor.py): the data
plane always, pyverbs only where RoCE is on, a kernel backend's module only where the
configuration may choose that backend."""

from __future__ import annotations

from typing import Any

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.supervisor import Supervisor


def preloaded(dataplane: dict[str, Any], roce: dict[str, Any] | None = None) -> list[str]:
    raw: dict[str, Any] = {"dataplane": {"address": "127.0.0.1", "mtu": 9000, **dataplane},
                           "api": {"listen": "", "unix_socket": "/tmp/unused.sock"}}
    if roce is not None:
        raw["roce"] = roce
    return Supervisor(parse(raw)).preloaded_modules()


def test_numpy_kernels_preload_the_data_plane_only() -> None:
    assert preloaded({"kernels": "numpy"}) == ["reduction_appliance.dataplane.loop"]


@pytest.mark.parametrize(("kernels", "backends"), [
    ("auto", ["torch", "ml_dtypes"]), ("torch", ["torch"]), ("numpy+ml_dtypes", ["ml_dtypes"])])
def test_a_backend_module_is_preloaded_where_it_may_be_chosen(kernels: str,
                                                              backends: list[str]) -> None:
    modules = preloaded({"kernels": kernels})
    assert modules[0] == "reduction_appliance.dataplane.loop"
    assert sorted(modules[1:]) == sorted(backends)
    assert not any(m.startswith("pyverbs") for m in modules)


def test_roce_preloads_its_transport_and_pyverbs() -> None:
    modules = preloaded({"kernels": "numpy"}, {"device": "rxe1"})  # (parse opens no device)
    assert "reduction_appliance.dataplane.roce" in modules
    assert {"pyverbs.qp", "pyverbs.cq", "pyverbs.mr"} <= set(modules)
