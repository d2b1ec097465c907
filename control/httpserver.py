"""A bounded HTTP/1.1 server on asyncio streams: what every API listener of reductiond runs on.

Why not `http.server`: ThreadingHTTPServer spends one thread per connection (2000 idle clients
are 2000 threads), trusts Content-Length (a negative one reads to end of stream), has no header
or idle timeout, and prints a traceback for every client that resets. Here a connection is a
coroutine on one event-loop thread; the blocking work (the Appliance waits on data-plane
processes) runs in a fixed pool of handler threads; every bound comes from `Limits`
(api.* in appliance.toml): open connections over all listeners, handler threads, body size,
header and idle timeouts, and the drain on stop.

Why h11 for the parsing rather than a hand-written parser: h11 is a small, pure-Python,
sans-I/O HTTP/1.1 state machine (python-hyper; under httpcore, httpx and uvicorn) that already
rejects the framing tricks hand-written parsers get wrong (negative, malformed, conflicting or
repeated Content-Length, transfer codings other than chunked, obsolete line folding, a header
block over a size bound), and being sans-I/O it leaves every read, limit and timeout to us.

Errors by fault: a client's protocol error is answered (400, 408, 411, 413, 431, 501) and the
connection closed; a client that goes away is a DEBUG line at most; only an unexpected failure
of this server is logged, as one WARNING line, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from http import HTTPStatus
from pathlib import Path
from typing import Any

import h11

from .httpmessages import App, Limits, Request, Response

__all__ = ["App", "HttpServer", "Limits", "Request", "Response"]

_log = logging.getLogger("reductiond.http")
_READ_CHUNK = 65536
_LINGER_S = 1.0  # after an error answer: discard what the client still sends, then close


class _HandlerPool:
    """A fixed set of daemon threads. Not concurrent.futures: its threads are joined at
    interpreter exit, so one handler stuck on a core would hold the daemon past its drain
    bound."""

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Response], Callable[[], bool],
                                            asyncio.Future[Response],
                                            asyncio.AbstractEventLoop] | None] = \
            queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-handler-{i}",
                                          daemon=True) for i in range(size)]
        for thread in self._threads:
            thread.start()

    def run(self, fn: Callable[[], Response], left: Callable[[], bool]
            ) -> asyncio.Future[Response]:
        """`fn` in a handler thread, unless `left()` says, when its turn comes, that the
        client has closed its end: it gave up waiting (an attempt's timeout) and will ask
        again, so serving it would only delay the rest (nginx's 499). Four thousand ranks
        joining at once queued for longer than their attempts waited, and every retry
        queued behind its own abandoned request: most of them never joined
        (benchmarks-journal.md, "Joins and leaves in batches")."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Response] = loop.create_future()
        self._jobs.put((fn, left, future, loop))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, left, future, loop = job
            try:
                outcome: Response | BaseException = _Abandoned() if left() else fn()
            except Exception as exc:
                outcome = exc
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(_settle, future, outcome)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _settle(future: asyncio.Future[Response], outcome: Response | BaseException) -> None:
    if future.done():  # cancelled by the drain
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class _Abandoned(Exception):
    """The client closed its end before its request's turn came: not served, not answered."""


class _Closing(Exception):
    """Answer `response` (if any) and close the connection."""

    def __init__(self, response: Response | None) -> None:
        super().__init__()
        self.response = response


class _Conn:
    __slots__ = ("busy", "task")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.busy = False  # a request of it is being read, handled or answered


class HttpServer:
    """Listeners (TCP or Unix) sharing one event-loop thread, one handler pool and one
    connection cap. Bind with `listen_tcp` / `listen_unix` (errors surface at once, in the
    caller), then `start`; `stop` drains. A context manager: entering starts, leaving stops."""

    def __init__(self, limits: Limits, name: str = "api") -> None:
        self.limits = limits
        self.name = name
        self._sockets: list[tuple[socket.socket, App, bool]] = []
        self._unix_paths: list[str] = []
        self._servers: list[asyncio.Server] = []
        self._conns: set[_Conn] = set()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: _HandlerPool | None = None
        self.abandoned = 0  # requests whose client closed before a handler took them

    @property
    def connections(self) -> int:
        return len(self._conns)

    def listen_tcp(self, address: tuple[str, int], app: App) -> tuple[str, int]:
        """Bind and listen now; return the bound address (port 0 picks one)."""
        host, port = self._listen(socket.AF_INET, address, app).getsockname()[:2]
        return str(host), int(port)

    def listen_unix(self, path: str, app: App, mode: int = 0o660) -> str:
        """Bind a Unix socket at `path` (an existing file must be removed first) and listen."""
        self._listen(socket.AF_UNIX, path, app, mode)
        self._unix_paths.append(path)
        return path

    def _listen(self, family: int, address: Any, app: App, mode: int = 0) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if family == socket.AF_INET:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            if mode:
                os.chmod(address, mode)
            sock.listen(self.limits.backlog)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sockets.append((sock, app, family == socket.AF_UNIX))
        return sock

    # ---- life ----
    def start(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(_loop_exception)
        self._loop = loop
        self._pool = _HandlerPool(self.limits.handler_threads, self.name)
        self._thread = threading.Thread(target=loop.run_forever, name=f"{self.name}-loop",
                                        daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), loop).result(timeout=30)

    async def _open(self) -> None:
        for sock, app, unix in self._sockets:
            def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         app: App = app) -> Any:
                return self._connection(reader, writer, app)
            if unix:
                server = await asyncio.start_unix_server(accepted, sock=sock,
                                                         backlog=self.limits.backlog)
            else:
                server = await asyncio.start_server(accepted, sock=sock,
                                                    backlog=self.limits.backlog)
            self._servers.append(server)

    @contextlib.contextmanager
    def tcp_ports_held(self) -> Iterator[None]:
        """Keep the TCP listeners' ports bound and listening (unanswered: the kernel queues
        connections, up to the backlog) until the block ends, `stop` or not: a worker that
        tries a connection while the daemon still drains its jobs must not be refused, since
        a refusal tells it that no reductiond runs here (plugin.silence)."""
        held = [sock.dup() for sock, _, unix in self._sockets if not unix]
        try:
            yield
        finally:
            for sock in held:
                sock.close()

    def stop(self) -> None:
        """Stop accepting, close idle connections, give requests in flight up to
        `limits.drain_s`, then close whatever is still open. Returns within about drain_s."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            with contextlib.suppress(TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(self._drain(), loop).result(
                    timeout=self.limits.drain_s + 2.0)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=2.0)
            if not thread.is_alive():
                loop.close()
        if self._pool is not None:
            self._pool.close()
        for sock, _, _ in self._sockets:
            sock.close()
        for path in self._unix_paths:
            Path(path).unlink(missing_ok=True)
        self._loop = self._thread = self._pool = None

    async def _drain(self) -> None:
        self._stopping = True
        for server in self._servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.drain_s
        for conn in list(self._conns):
            if not conn.busy and conn.task is not None:
                conn.task.cancel()
        while (busy := [c.task for c in self._conns if c.task is not None]) \
                and loop.time() < deadline:
            await asyncio.wait(busy, timeout=deadline - loop.time())
        left = [c.task for c in self._conns if c.task is not None]
        for task in left:
            task.cancel()
        if left:
            _log.info("%s: closed %d connection(s) still busy after the %g s drain",
                      self.name, len(left), self.limits.drain_s)
            await asyncio.wait(left, timeout=1.0)

    def responsive(self, timeout_s: float = 1.0) -> bool:
        """Whether the event loop runs a callback within `timeout_s` (the watchdog's test)."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            return False
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=timeout_s)
        except (TimeoutError, RuntimeError):
            return False
        return True

    def __enter__(self) -> HttpServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- one connection ----
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          app: App) -> None:
        if self._stopping or len(self._conns) >= self.limits.max_connections:
            writer.write(_raw(Response.error(503, "too many connections; retry later")))
            writer.close()
            return
        conn = _Conn(asyncio.current_task())
        self._conns.add(conn)
        # drain() then waits until the answer is wholly in the kernel, so closing never cuts it
        writer.transport.set_write_buffer_limits(high=0)
        peer = _peer(writer)
        try:
            await self._serve(conn, reader, writer, app, peer)
        except _Closing as closing:
            if closing.response is not None:
                await _answer_and_linger(reader, writer, closing.response)
        except asyncio.CancelledError:
            pass  # stopping: the drain closes it
        except (ConnectionError, TimeoutError) as exc:  # gone, or not reading its answer
            _log.debug("%s: %s went away: %s", self.name, peer, exc)
        except Exception as exc:  # ours: one line, never a traceback
            _log.warning("%s: connection from %s failed: %s: %s", self.name, peer,
                         type(exc).__name__, exc)
        finally:
            self._conns.discard(conn)
            writer.transport.abort()

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, app: App, peer: str) -> None:
        limits = self.limits
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        first = True
        while not self._stopping:
            conn.busy = False
            head = await self._read_head(h, reader, first, conn)
            if head is None:
                return
            first = False
            size = len(head.target) + sum(len(k) + len(v) + 4 for k, v in head.headers)
            if size > limits.max_head_bytes:  # h11 bounds only a head still incomplete
                raise _Closing(Response.error(431, "request head over "
                                              f"{limits.max_head_bytes} bytes"))
            request = _request(head, peer)
            if any(k == b"transfer-encoding" for k, _ in head.headers):
                raise _Closing(Response.error(411, "chunked bodies are not accepted: send "
                                              f"Content-Length (at most "
                                              f"{limits.max_body_bytes} bytes)"))
            if (request.content_length or 0) > limits.max_body_bytes:
                raise _Closing(Response.error(413, "request body over "
                                              f"{limits.max_body_bytes} bytes"))
            try:
                early = app.check(request)
            except Exception as exc:  # the app should have answered: ours, one line
                early = self._failed(request, exc)
            if early is not None:  # refused (401, 404, 411...): a body may follow unread
                raise _Closing(early)
            body = await self._read_body(h, reader, writer)
            assert self._pool is not None
            try:
                response = await self._pool.run(
                    functools.partial(app.respond, replace(request, body=body)),
                    functools.partial(_client_left, reader, writer))
            except _Abandoned:
                self.abandoned += 1
                _log.debug("%s: %s left before %s %s was served", self.name, peer,
                           request.method, request.path)
                return
            except Exception as exc:  # the app should have mapped it: ours, one line
                response = self._failed(request, exc)
            await self._send(h, writer, response)

    def _failed(self, request: Request, exc: Exception) -> Response:
        _log.error("%s: %s %s failed: %s: %s", self.name, request.method, request.path,
                   type(exc).__name__, exc)
        return Response.error(500, f"internal {type(exc).__name__}: {exc}")

    async def _read_head(self, h: h11.Connection, reader: asyncio.StreamReader, first: bool,
                         conn: _Conn) -> h11.Request | None:
        """The next request's head, or None when the client closed or idled out. A new
        connection gets header_timeout_s to send its first request; a kept-alive one waits
        idle_timeout_s for the first byte of the next, then header_timeout_s for the rest."""
        loop = asyncio.get_running_loop()
        started = bool(h.trailing_data[0])
        conn.busy = started
        deadline = loop.time() + (self.limits.header_timeout_s if first or started
                                  else self.limits.idle_timeout_s)
        while True:
            event = _next_event(h)
            if isinstance(event, h11.Request):
                conn.busy = True
                return event
            if isinstance(event, h11.ConnectionClosed):
                return None
            if event is not h11.NEED_DATA:  # nothing else can come before a request
                raise _Closing(Response.error(400, "expected a request"))
            data = await _read(reader, deadline)
            if data is None:
                if started:
                    raise _Closing(Response.error(408, "request head not received within "
                                                  f"{self.limits.header_timeout_s:g} s"))
                return None
            if not started and data:
                started = conn.busy = True
                deadline = loop.time() + self.limits.header_timeout_s
            h.receive_data(data)

    async def _read_body(self, h: h11.Connection, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> bytes:
        """The body, never more than the Content-Length already checked against the cap."""
        if h.they_are_waiting_for_100_continue:
            writer.write(_send(h, h11.InformationalResponse(status_code=100, headers=[])))
        deadline = asyncio.get_running_loop().time() + self.limits.header_timeout_s
        body = bytearray()
        while True:
            event = _next_event(h)
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError("closed in the middle of a request body")
            else:
                data = await _read(reader, deadline)
                if data is None:
                    raise _Closing(Response.error(408, "request body not received within "
                                                  f"{self.limits.header_timeout_s:g} s"))
                h.receive_data(data)

    async def _send(self, h: h11.Connection, writer: asyncio.StreamWriter,
                    response: Response) -> None:
        headers = [("Content-Type", response.content_type),
                   ("Content-Length", str(len(response.body))), *response.headers]
        if self._stopping:
            headers.append(("Connection", "close"))
        writer.write(_send(h, h11.Response(status_code=response.status, headers=headers,
                                           reason=_reason(response.status)))
                     + _send(h, h11.Data(data=response.body)) + _send(h, h11.EndOfMessage()))
        async with asyncio.timeout(self.limits.idle_timeout_s):
            await writer.drain()
        if h.our_state is h11.MUST_CLOSE:
            raise _Closing(None)
        h.start_next_cycle()


_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8  # tcp_info's state: reset; the client's FIN came


def _client_left(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Whether the client closed its end (called from a handler thread). TCP asks the kernel,
    which knows of a FIN or reset before the loop reads it; a Unix socket has the reader's end
    of stream. A socket already closed (the server stopping) counts as left, and so does a
    client that shut its sending side down to wait for the answer (as nginx takes it; no
    client of ours does, nor urllib, http.client or curl)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            return True
        if state in (_TCP_CLOSE, _TCP_CLOSE_WAIT):
            return True
    return reader.at_eof()  # (a plain flag)


def _send(h: h11.Connection, event: Any) -> bytes:
    return h.send(event) or b""


def _next_event(h: h11.Connection) -> Any:
    try:
        return h.next_event()
    except h11.RemoteProtocolError as exc:
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 600 else 400
        raise _Closing(Response.error(status, f"malformed request: {exc}")) from None


async def _read(reader: asyncio.StreamReader, deadline: float) -> bytes | None:
    """Some bytes (b"" at end of stream), or None when the deadline passed first."""
    try:
        async with asyncio.timeout_at(deadline):
            return await reader.read(_READ_CHUNK)
    except TimeoutError:
        return None


async def _answer_and_linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             response: Response) -> None:
    """Answer, half-close, and discard what the client still sends for up to _LINGER_S:
    closing with its body unread would reset the connection and could lose the answer."""
    with contextlib.suppress(ConnectionError, TimeoutError):
        writer.write(_raw(response))
        async with asyncio.timeout(_LINGER_S):
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            while await reader.read(_READ_CHUNK):
                pass


def _raw(response: Response) -> bytes:
    """A whole answer that closes the connection, whatever state the parser is in."""
    head = (f"HTTP/1.1 {response.status} {_reason(response.status)}\r\n"
            f"Content-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in response.headers)
            + "Connection: close\r\n\r\n")
    return head.encode("latin-1") + response.body


def _request(head: h11.Request, peer: str) -> Request:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
    length = headers.get("content-length")
    target = head.target.decode("latin-1")
    return Request(method=head.method.decode("latin-1"), path=target.partition("?")[0],
                   headers=headers, content_length=int(length) if length is not None else None,
                   peer=peer)


def _reason(status: int) -> str:
    with contextlib.suppress(ValueError):
        return HTTPStatus(status).phrase
    return "Unknown"


def _peer(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "unix"


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Whatever asyncio itself reports (it would print a traceback): one line."""
    exc = context.get("exception")
    _log.warning("api event loop: %s%s", context.get("message", "error"),
                 f": {type(exc).__name__}: {exc}" if exc is not None else "")
