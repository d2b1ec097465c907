"""What reductiond's HTTP server (control/httpserver.py) and the apps it serves share: the
server's bounds (`Limits`), a request and a response, and what a listener serves (`App`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from .config import ApiConfig

__all__ = ["App", "Limits", "Request", "Response"]


@dataclass(frozen=True)
class Limits:
    """Every bound of the server (the defaults are ApiConfig's)."""

    max_connections: int = 16384  # open connections over all listeners; beyond: 503, close
    handler_threads: int = 8  # requests handled at once; the rest queue, no thread each
    max_body_bytes: int = 65536  # a larger announced body gets 413 before it is read
    header_timeout_s: float = 10.0  # a request's head (and then its body) must arrive in this
    idle_timeout_s: float = 30.0  # a keep-alive connection waits this long for a next request
    drain_s: float = 5.0  # on stop: the longest wait for requests in flight
    # Listen queue (the kernel caps it at net.core.somaxconn, 4096 by default): a job's ranks
    # connect at once, and a connection beyond it waits for a retransmitted SYN (1 s, 3 s...).
    backlog: int = 4096
    max_head_bytes: int = 16384  # request line + headers; beyond: 431

    @classmethod
    def from_config(cls, api: ApiConfig) -> Limits:
        return cls(max_connections=api.max_connections, handler_threads=api.handler_threads,
                   max_body_bytes=api.max_body_bytes, header_timeout_s=api.header_timeout_s,
                   idle_timeout_s=api.idle_timeout_s, drain_s=api.drain_s)


@dataclass(frozen=True)
class Request:
    """A request; `check` sees its head (body b""), `respond` the whole of it."""

    method: str
    path: str  # without the query string
    headers: Mapping[str, str]  # names in lower case
    content_length: int | None  # None: the client announced none
    peer: str
    body: bytes = b""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, status: int, value: object,
             headers: tuple[tuple[str, str], ...] = ()) -> Response:
        return cls(status, json.dumps(value).encode(), "application/json", headers)

    @classmethod
    def error(cls, status: int, reason: str) -> Response:
        return cls.json(status, {"error": reason})


class App(Protocol):
    """What a listener serves."""

    def check(self, head: Request) -> Response | None:
        """An answer from the head alone (authentication, an unknown route, a body the route
        needs but no Content-Length), or None to read the body and `respond`. Runs on the
        event loop: it must not block."""

    def respond(self, request: Request) -> Response:
        """The answer. Runs in a handler thread: it may block. It should map its own errors;
        one that escapes is answered 500 and logged in one line."""
