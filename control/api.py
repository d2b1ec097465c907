"""The appliance's JSON API over HTTP: workers register jobs, tools read status.

    POST   /v1/jobs        {"name", "world_size", "deterministic"?, "multicast"?} -> the job
    GET    /v1/jobs        -> every job
    DELETE /v1/jobs/ID     -> removed
    GET    /v1/status      -> version, uptime, cores with their counters, jobs
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dataplane.counters import Counter
from dataplane.errors import AdmissionError, ReductionError

from .registry import ConflictError, JobRequest, Registry
from .supervisor import Supervisor

__all__ = ["ApiServer", "Appliance"]

VERSION = "0.1.0"


class Appliance:
    """What the API acts on: the registry (decides) and the supervisor (applies)."""

    def __init__(self, registry: Registry, supervisor: Supervisor) -> None:
        self.registry = registry
        self.supervisor = supervisor
        self.started = time.time()
        self._lock = threading.Lock()

    def create_job(self, body: dict[str, Any]) -> dict[str, object]:
        try:
            request = JobRequest(
                name=str(body["name"]), world_size=int(body["world_size"]),
                deterministic=bool(body.get("deterministic", False)),
                multicast=bool(body.get("multicast", True)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad job spec: {exc!r}; need name and world_size") from exc
        with self._lock:
            plan = self.registry.plan(request, cookie=secrets.randbits(64))
            if self.registry.find(request.name) is None:
                self.supervisor.add_job(plan.spec)
                self.registry.commit(plan)
        return plan.describe(self.registry.cfg)

    def remove_job(self, job_id: int) -> bool:
        with self._lock:
            plan = self.registry.remove(job_id)
            if plan is None:
                return False
            self.supervisor.remove_job(job_id)
            return True

    def status(self) -> dict[str, object]:
        cfg = self.registry.cfg
        return {
            "version": VERSION, "uptime_s": round(time.time() - self.started, 3),
            "config": cfg.source,
            "cores": [
                {"core": c.config.index, "pid": c.process.pid, "cpu": c.config.cpu,
                 "alive": c.process.is_alive(), "port": c.config.bind[1],
                 "counters": c.counters.snapshot()}
                for c in self.supervisor.cores
            ],
            "jobs": [p.describe(cfg) | {"cookie": None} for p in self.registry.jobs],
        }

    def bytes_out(self) -> int:
        return sum(c.counters[Counter.BYTES_OUT] for c in self.supervisor.cores)


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the API is polled by tools; access logs would drown the daemon's own log

    def _reply(self, status: HTTPStatus, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        return body

    def do_GET(self) -> None:
        app = self.server.appliance
        if self.path == "/v1/status":
            self._reply(HTTPStatus.OK, app.status())
        elif self.path == "/v1/jobs":
            self._reply(HTTPStatus.OK, app.status()["jobs"])
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such resource {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/v1/jobs":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such resource {self.path}"})
            return
        try:
            self._reply(HTTPStatus.OK, self.server.appliance.create_job(self._body()))
        except ConflictError as exc:
            self._reply(HTTPStatus.CONFLICT, {"error": str(exc)})
        except (ValueError, AdmissionError) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        except ReductionError as exc:
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)})

    def do_DELETE(self) -> None:
        prefix = "/v1/jobs/"
        if not self.path.startswith(prefix) or not self.path[len(prefix):].isdigit():
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such resource {self.path}"})
            return
        job_id = int(self.path[len(prefix):])
        if self.server.appliance.remove_job(job_id):
            self._reply(HTTPStatus.OK, {"removed": job_id})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no job {job_id}"})


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], appliance: Appliance) -> None:
        self.appliance = appliance
        super().__init__(address, _Handler)
