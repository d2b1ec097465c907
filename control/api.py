"""The appliance's JSON API over HTTP: workers register jobs, tools read status.

    POST   /v1/jobs                 {"name", "world_size", "deterministic"?, "multicast"?,
                                     "slots"?, "secret"?}           -> the job (idempotent;
                                     its creator gets the made-up secret when it gave none)
    GET    /v1/jobs                 -> every job (never a cookie or a secret)
    GET    /v1/jobs/ID              -> one job
    POST   /v1/jobs/ID/join         {"rank", "secret", "address", "port", "rejoin"?}
                                                                    -> the job, with its cookie
    POST   /v1/jobs/ID/resync       {"secret", "epoch"}             -> the job in a new epoch
    POST   /v1/jobs/ID/leave        {"rank", "secret"}              -> the job
    POST   /v1/jobs/ID/abort        -> the job, now aborted (its workers are told)
    DELETE /v1/jobs/ID              -> same as abort
    GET    /v1/status               -> the whole appliance (control.snapshot)
    GET    /metrics                 -> Prometheus text

Served on TCP for workers (a bearer token is required when api.token_file is set: 401
otherwise) and on a Unix socket for reductionctl (guarded by the socket's file permissions).
Errors are JSON `{"error": reason}`. The caller's faults (`RequestError`) carry their own 4xx
status and say what to change: 400 bad request, 401 bad token, 403 not the job's secret, 404
unknown job, 409 a conflict with the job's state or spec (a rank joined twice), or a job that
does not fit. 503: the appliance cannot serve it
now (a core restarting, shutting down). 500: our fault, logged with its traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import socket
import socketserver
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from reduction_appliance.dataplane.errors import (
    BadRequest,
    ReductionError,
    RequestError,
    Unavailable,
)

from .metrics import CONTENT_TYPE, render
from .service import Appliance

__all__ = ["ApiServer", "MetricsServer", "UnixApiServer"]

_log = logging.getLogger("reductiond.api")
_JOB_ACTION = re.compile(r"^/v1/jobs/(\d+)(?:/(join|leave|resync|abort))?$")
_MAX_BODY = 64 * 1024


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer | UnixApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the API is polled by tools; access logs would drown the daemon's own log

    def address_string(self) -> str:
        return "unix" if isinstance(self.client_address, str) else super().address_string()

    # ---- plumbing ----
    def _reply(self, status: HTTPStatus, body: object, content_type: str = "") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type or "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            raise BadRequest(f"request body over {_MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as exc:
            raise BadRequest(f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _authorised(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip(), token):
            return True
        self.send_response(HTTPStatus.UNAUTHORIZED)
        self.send_header("WWW-Authenticate", 'Bearer realm="reduction-appliance"')
        data = json.dumps({"error": "missing or wrong bearer token"}).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return False

    def _dispatch(self, action: Callable[[], tuple[HTTPStatus, object, str]]) -> None:
        if not self._authorised():
            return
        try:
            status, body, content_type = action()
        except RequestError as exc:  # the caller's fault: say what to change
            status, body, content_type = HTTPStatus(exc.status), {"error": str(exc)}, ""
        except Unavailable as exc:
            status, body, content_type = HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)}, ""
        except Exception as exc:  # ours: never the caller's 4xx
            _log.exception("%s %s failed", self.command, self.path)
            kind = type(exc).__name__ if not isinstance(exc, ReductionError) else "error"
            status, body, content_type = (HTTPStatus.INTERNAL_SERVER_ERROR,
                                          {"error": f"internal {kind}: {exc}"}, "")
        self._reply(status, body, content_type)

    # ---- routes ----
    def do_GET(self) -> None:
        app = self.server.appliance

        def route() -> tuple[HTTPStatus, object, str]:
            if self.path == "/v1/status":
                return HTTPStatus.OK, app.snapshot().to_json(), ""
            if self.path == "/metrics":
                return HTTPStatus.OK, render(app.snapshot()), CONTENT_TYPE
            if self.path == "/v1/jobs":
                return HTTPStatus.OK, [j.to_json() for j in app.jobs()], ""
            match = _JOB_ACTION.match(self.path)
            if match and match.group(2) is None:
                return HTTPStatus.OK, app.job(int(match.group(1))).to_json(), ""
            return HTTPStatus.NOT_FOUND, {"error": f"no such resource {self.path}"}, ""

        self._dispatch(route)

    def do_POST(self) -> None:
        app = self.server.appliance

        def route() -> tuple[HTTPStatus, object, str]:
            if self.path == "/v1/jobs":
                return HTTPStatus.OK, app.create_job(self._body()).to_json(), ""
            match = _JOB_ACTION.match(self.path)
            if not match or match.group(2) is None:
                return HTTPStatus.NOT_FOUND, {"error": f"no such resource {self.path}"}, ""
            job_id, action = int(match.group(1)), match.group(2)
            if action == "abort":
                return HTTPStatus.OK, app.abort(job_id).to_json(), ""
            handler = {"join": app.join, "leave": app.leave, "resync": app.resync}[action]
            return HTTPStatus.OK, handler(job_id, self._body()).to_json(), ""

        self._dispatch(route)

    def do_DELETE(self) -> None:
        app = self.server.appliance

        def route() -> tuple[HTTPStatus, object, str]:
            match = _JOB_ACTION.match(self.path)
            if not match or match.group(2) is not None:
                return HTTPStatus.NOT_FOUND, {"error": f"no such resource {self.path}"}, ""
            return HTTPStatus.OK, app.abort(int(match.group(1))).to_json(), ""

        self._dispatch(route)


class ApiServer(ThreadingHTTPServer):
    """TCP, for workers; token-checked when a token is given."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], appliance: Appliance,
                 token: str | None) -> None:
        self.appliance = appliance
        self.token = token
        super().__init__(address, _Handler)


class UnixApiServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The same API on a Unix socket, for reductionctl on the appliance host."""

    daemon_threads = True
    token = None

    def __init__(self, path: str, appliance: Appliance) -> None:
        self.appliance = appliance
        self.path = path
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if Path(path).is_socket():
            _remove_stale_socket(path)
        super().__init__(path, _Handler)
        os.chmod(path, 0o660)

    def server_close(self) -> None:
        super().server_close()
        Path(self.path).unlink(missing_ok=True)


class MetricsServer(ThreadingHTTPServer):
    """A separate, unauthenticated Prometheus endpoint (GET /metrics only)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], appliance: Appliance) -> None:
        self.appliance = appliance
        self.token = None
        super().__init__(address, _MetricsHandler)


class _MetricsHandler(_Handler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            self._reply(HTTPStatus.NOT_FOUND, {"error": "only /metrics here"})
            return
        self._reply(HTTPStatus.OK, render(self.server.appliance.snapshot()), CONTENT_TYPE)

    def do_POST(self) -> None:
        self._reply(HTTPStatus.NOT_FOUND, {"error": "only GET /metrics here"})

    do_DELETE = do_POST


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a crashed daemon blocks bind; one that answers belongs to a live
    daemon, which we must not steal from."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        Path(path).unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise ReductionError(f"another reductiond is serving {path}")
