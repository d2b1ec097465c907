"""The control plane and its cores across the process boundary, and the API's answers by whose
fault an error is: real data-plane processes, a real HTTP server on loopback."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from reduction_appliance.control.api import ApiApp
from reduction_appliance.control.config import parse
from reduction_appliance.control.httpserver import HttpServer, Limits
from reduction_appliance.control.supervisor import Supervisor
from reduction_appliance.dataplane.errors import (
    AdmissionError,
    BadRequest,
    CoreFailure,
    NotFound,
    RankHeld,
    Unavailable,
)
from reduction_appliance.dataplane.spec import Command, CoreStats, JobSpec, QueryStats


class NoSuchCommand(Command[None]):
    """A command no core knows (pickled by reference: the core imports this module)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    cfg = parse({"dataplane": {"address": "127.0.0.1", "base_port": _free_port(),
                               "kernels": "numpy", "slot_memory_mb": 4, "mtu": 9000},
                 "api": {"listen": "", "unix_socket": "/tmp/unused.sock"}})
    with Supervisor(cfg) as sup:
        yield sup


def test_a_real_core_reports_typed_errors_and_keeps_serving(supervisor: Supervisor) -> None:
    core = supervisor.cores[0]
    assert core.kernels == "numpy"
    with pytest.raises(CoreFailure, match=r"TypeError.*NoSuchCommand"):
        supervisor.ask(core, NoSuchCommand())
    spec = JobSpec(1, 7, 2, 4)
    supervisor.add_job(spec)
    with pytest.raises(AdmissionError, match="already exists"):
        supervisor.add_job(spec)  # a core's refusal arrives as the class it raised
    with pytest.raises(AdmissionError, match="slots"):
        supervisor.add_job(JobSpec(2, 7, 2, 10**6))
    stats = supervisor.ask(core, QueryStats((1,)))
    assert isinstance(stats, CoreStats) and stats.jobs[1] is not None


class _Stub:
    """An Appliance whose every request fails the way a test says."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def create_job(self, *_: Any) -> Any:
        raise self.error

    job = abort = create_job


@pytest.mark.parametrize(("error", "status", "says"), [
    (BadRequest("world_size must be 1..4096, got 0"), 400, "world_size must be"),
    (NotFound("no job 9"), 404, "no job 9"),
    (AdmissionError("needs 8 slot pairs"), 409, "needs 8 slot pairs"),
    (RankHeld("rank 0 of job 1 is already joined", 3.25), 409, "already joined"),
    (Unavailable("core 0 is restarting"), 503, "restarting"),
    (CoreFailure("core 0 failed: KeyError: 3"), 500, "internal"),
    (KeyError("a bug of ours"), 500, "internal KeyError"),
])
def test_the_api_answers_by_whose_fault(error: Exception, status: int, says: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    server = HttpServer(Limits())
    _, port = server.listen_tcp(("127.0.0.1", 0), ApiApp(_Stub(error), None))  # type: ignore[arg-type]
    with server, caplog.at_level(logging.INFO, logger="reductiond"):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs", method="POST",
                                         data=b'{"name": "j", "world_size": 2}')
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as answer:
            opener.open(request, timeout=10)
        assert answer.value.code == status
        body = json.loads(answer.value.read())
        assert says in body["error"]
        # A held rank says when it may pass; nothing else names a wait.
        assert body.get("retry_after_s") == (3.25 if isinstance(error, RankHeld) else None)
    logged = [r for r in caplog.records if r.name.startswith("reductiond")]
    if status == 500:  # ours: exactly one line, no traceback
        assert len(logged) == 1 and logged[0].exc_info is None, logged
        assert "\n" not in logged[0].getMessage()
    else:  # the caller's fault or a 503: nothing to log
        assert logged == []
