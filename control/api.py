"""The appliance's JSON API over HTTP: workers register jobs, tools read status.

    POST   /v1/jobs                 {"name", "world_size", "deterministic"?, "multicast"?,
                                     "slots"?, "secret"?, "transport"?} -> the job (idempotent;
                                     its creator gets the made-up secret when it gave none)
    GET    /v1/jobs                 -> every job (never a cookie or a secret)
    GET    /v1/jobs/ID              -> one job
    POST   /v1/jobs/ID/join         {"rank", "secret", "address", "port", "rejoin"?,
                                     "lanes"?, "window_cap"?}       -> the job, with its cookie
                                     (window_cap: the window its receive buffer holds)
    POST   /v1/jobs/ID/resync       {"secret", "epoch"}             -> the job in a new epoch
    POST   /v1/jobs/ID/leave        {"rank", "secret"}              -> the job
    POST   /v1/jobs/ID/unicast      {"rank", "secret"}              -> the job, its results by
                                     unicast fan-out from now on (a rank hears no multicast)
    POST   /v1/jobs/ID/connect      {"rank", "secret", "address", "queue_pairs"}
                                    -> {"address", "queue_pairs"}: a RoCE job's queue pairs
    POST   /v1/jobs/ID/abort        -> the job, now aborted (its workers are told); a rank
                                     aborting it sends {"rank", "secret", "reason"}, and its
                                     peers are told the reason
    DELETE /v1/jobs/ID              -> same as abort
    GET    /v1/status               -> the whole appliance (control.snapshot)
    GET    /metrics                 -> Prometheus text

Served on TCP for workers (a bearer token is required when api.token_file is set: 401
otherwise), on a Unix socket for reductionctl (guarded by the socket's file permissions), and
optionally GET /metrics alone on a separate port; all three on the one bounded server of
control/httpserver.py. Errors are JSON `{"error": reason}`. The caller's faults
(`RequestError`) carry their own 4xx status and say what to change: 400 bad request (also a
body that is not a JSON object, or nested deeper than 32), 401 bad token, 403 not the job's
secret, 404 unknown job, 409 a conflict with the job's state or spec (a rank joined twice), or
a job that does not fit; 410 a job aborted (a late rank of its run: control/aborts.py); 411 a
body sent without Content-Length, 413 one over api.max_body_bytes (both answered from the
headers alone). 503: the appliance cannot serve it now (a core restarting, shutting down, too
many connections). 500: our fault, logged as one line.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import re
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reduction_appliance.dataplane.errors import (
    BadRequest,
    ReductionError,
    RequestError,
    Unavailable,
)

from .config import ApplianceConfig
from .httpserver import HttpServer, Limits, Request, Response
from .metrics import CONTENT_TYPE, render
from .service import Appliance

__all__ = ["MAX_JSON_DEPTH", "ApiApp", "MetricsApp", "build_server"]

_log = logging.getLogger("reductiond.api")
_JOB_ACTION = re.compile(
    r"^/v1/jobs/(\d+)(?:/(join|leave|resync|unicast|abort|connect))?$")
#: Deepest JSON nesting a body may have: our bodies are flat objects; json's recursion on a
#: deeper one would cost a stack per level (and a RecursionError at ~1000).
MAX_JSON_DEPTH = 32
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)

_Action = Callable[[Appliance, Request], Response]


@dataclass(frozen=True)
class _Route:
    action: _Action
    needs_body: bool = False


def _route(method: str, path: str) -> _Route | Response:
    """The route a request names, or the answer saying why there is none."""
    if method not in ("GET", "POST", "DELETE"):
        return Response.error(501, f"unsupported method {method}")
    match = _JOB_ACTION.match(path)
    job_id = int(match.group(1)) if match else 0
    action = match.group(2) if match else None
    if method == "GET":
        if path == "/v1/status":
            return _Route(lambda app, _: Response.json(200, app.snapshot().to_json()))
        if path == "/metrics":
            return _Route(lambda app, _: Response(200, render(app.snapshot()),
                                                  CONTENT_TYPE))
        if path == "/v1/jobs":
            return _Route(lambda app, _: Response.json(200, [j.to_json() for j in app.jobs()]))
        if match and action is None:
            return _Route(lambda app, _: Response.json(200, app.job(job_id).to_json()))
    elif method == "POST":
        if path == "/v1/jobs":
            return _Route(lambda app, r: Response.json(200, app.create_job(
                json_object(r.body)).to_json()), needs_body=True)
        if action == "abort":  # an operator's (no body) or a rank's, saying why
            return _Route(lambda app, r: Response.json(200, app.abort(
                job_id, json_object(r.body) if r.body else None).to_json()))
        if action == "connect":
            return _Route(lambda app, r: Response.json(200, app.connect(
                job_id, json_object(r.body))), needs_body=True)
        if action in ("join", "leave", "resync", "unicast"):
            def act(app: Appliance, r: Request) -> Response:
                handler = {"join": app.join, "leave": app.leave, "resync": app.resync,
                           "unicast": app.unicast}[action]
                answer = handler(job_id, json_object(r.body))
                return Response(200, answer.encoded, "application/json")
            return _Route(act, needs_body=True)
    elif match and action is None:  # DELETE
        return _Route(lambda app, _: Response.json(200, app.abort(job_id).to_json()))
    return Response.error(404, f"no such resource {path}")


def json_object(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object; `BadRequest` says what is wrong with it. The nesting
    is checked before parsing, so json's recursion never runs deep."""
    depth = 0
    for token in _JSON_TOKENS.finditer(data):
        bracket = token.group()
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        elif bracket in (b"]", b"}"):
            depth -= 1
    try:
        body = json.loads(data or b"{}")
    except RecursionError:
        raise BadRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, or bytes in no JSON encoding
        raise BadRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


class ApiApp:
    """The routes above for one listener; `token` (TCP only) is checked from the head."""

    def __init__(self, appliance: Appliance, token: str | None) -> None:
        self.appliance = appliance
        self.token = token

    def check(self, head: Request) -> Response | None:
        if self.token is not None:
            given = head.headers.get("authorization", "")
            if not (given.startswith("Bearer ")
                    and hmac.compare_digest(given[7:].strip().encode(), self.token.encode())):
                return Response.json(401, {"error": "missing or wrong bearer token"},
                                     (("WWW-Authenticate", 'Bearer realm="reduction-appliance"'),))
        route = _route(head.method, head.path)
        if isinstance(route, Response):
            return route
        if route.needs_body and head.content_length is None:
            return Response.error(411, f"{head.method} {head.path} needs a JSON body with a "
                                  "Content-Length header")
        return None

    def respond(self, request: Request) -> Response:
        route = _route(request.method, request.path)
        if isinstance(route, Response):
            return route
        try:
            return route.action(self.appliance, request)
        except RequestError as exc:  # the caller's fault: say what to change (or when to ask)
            if exc.retry_after_s is None:
                return Response.error(exc.status, str(exc))
            return Response.json(exc.status, {"error": str(exc),
                                              "retry_after_s": exc.retry_after_s})
        except Unavailable as exc:
            return Response.error(503, str(exc))
        except Exception as exc:  # ours: never the caller's 4xx; one line, where it failed
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            _log.error("%s %s failed: %s: %s (at %s:%s in %s)", request.method, request.path,
                       type(exc).__name__, exc, Path(frame.filename).name, frame.lineno,
                       frame.name)
            kind = type(exc).__name__ if not isinstance(exc, ReductionError) else "error"
            return Response.error(500, f"internal {kind}: {exc}")


class MetricsApp:
    """A separate, unauthenticated Prometheus endpoint: GET /metrics and nothing else."""

    def __init__(self, appliance: Appliance) -> None:
        self.appliance = appliance

    def check(self, head: Request) -> Response | None:
        if head.method != "GET" or head.path != "/metrics":
            return Response.error(404, "only GET /metrics here")
        return None

    def respond(self, request: Request) -> Response:
        try:
            return Response(200, render(self.appliance.snapshot()), CONTENT_TYPE)
        except Unavailable as exc:
            return Response.error(503, str(exc))


def build_server(cfg: ApplianceConfig, appliance: Appliance,
                 token: str | None) -> tuple[HttpServer, list[str]]:
    """One bounded server with every listener the config asks for, bound now (so a port in
    use fails the start), and a description of each for the ready line."""
    server = HttpServer(Limits.from_config(cfg.api))
    where: list[str] = []
    binding = ""  # the listener being bound, in the config's terms, for the error
    try:
        if cfg.api.listen is not None:
            listen = cfg.api.listen
            binding = f"api.listen = {listen.host}:{listen.port}"
            host, port = server.listen_tcp((listen.host, listen.port), ApiApp(appliance, token))
            where.append(f"api {host}:{port}{' (token)' if token else ''}")
        if cfg.api.unix_socket:
            path = cfg.api.unix_socket
            binding = f"api.unix_socket = {path}"
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if Path(path).is_socket():
                _remove_stale_socket(path)
            server.listen_unix(path, ApiApp(appliance, None))
            where.append(f"unix {path}")
        if cfg.metrics.listen is not None:
            metrics = cfg.metrics.listen
            binding = f"metrics.listen = {metrics.host}:{metrics.port}"
            host, port = server.listen_tcp((metrics.host, metrics.port), MetricsApp(appliance))
            where.append(f"metrics {host}:{port}")
    except OSError as exc:
        server.stop()
        taken = (" (another reductiond, or another service, has it: stop that or choose "
                 "another port)" if exc.errno == errno.EADDRINUSE else "")
        raise ReductionError(f"cannot listen on {binding}: {exc.strerror or exc}{taken}") from exc
    except BaseException:
        server.stop()
        raise
    return server, where


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
