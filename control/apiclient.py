"""A client for the appliance API on its Unix socket: what reductionctl and the test harness use
on the appliance host (no network traffic, no token: the socket's permissions guard it)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from typing import Any

from reduction_appliance.dataplane.errors import ReductionError

__all__ = ["ApiError", "UnixApi"]


class ApiError(ReductionError):
    """The API answered with an error status (`status`), or could not be reached (0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class UnixApi:
    def __init__(self, path: str, timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    def request(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        conn = _UnixConnection(self.path, self.timeout_s)
        try:
            data = json.dumps(body).encode() if body is not None else None
            # The server may answer without reading the request and close (a 503 at its
            # connection cap): sending then fails, but its answer is still ours to read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.request(method, url, body=data,
                             headers={"Content-Type": "application/json"} if data else {})
            reply = conn.getresponse()
            raw = reply.read()
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, not HTTP
            hint = ""
            if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
                hint = (" (is reductiond running? `systemctl status reductiond`; one started "
                        "with another api.unix_socket: give --socket or --config)")
            raise ApiError(0, f"cannot reach reductiond at {self.path}: "
                              f"{type(exc).__name__}: {exc}{hint}") from exc
        finally:
            conn.close()
        try:
            if reply.getheader("Content-Type", "").startswith("application/json"):
                value = json.loads(raw)
            else:
                value = raw.decode()
        except ValueError as exc:
            raise ApiError(reply.status, f"{method} {url}: {reply.status} with an unreadable "
                                         f"body: {exc}") from exc
        if reply.status >= 400:
            reason = value.get("error", value) if isinstance(value, dict) else value
            raise ApiError(reply.status, f"{method} {url}: {reply.status} {reason}")
        return value

    def get(self, url: str) -> Any:
        return self.request("GET", url)
