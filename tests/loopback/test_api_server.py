"""The bounded API server in-process, on loopback: what a client cannot do to it (oversized,
unannounced, malformed or chunked bodies, deep JSON, too many or too slow connections,
resets), what it bounds (handler threads), and how it stops."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reduction_appliance.control.api import MAX_JSON_DEPTH, ApiApp, MetricsApp
from reduction_appliance.control.apiclient import ApiError, UnixApi
from reduction_appliance.control.httpserver import HttpServer, Limits
from tests.waiting import wait_until


class _Described:
    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def to_json(self) -> dict[str, Any]:
        return self.value


class _Appliance:
    """Answers every route at once, or blocks create_job on `gate` when one is set."""

    def __init__(self) -> None:
        self.gate: threading.Event | None = None
        self.gates: dict[str, threading.Event] = {}  # by job name, before `gate`
        self.inside = 0
        self.most_inside = 0
        self.served: list[str] = []  # names of the jobs create_job was called for
        self._lock = threading.Lock()

    def snapshot(self) -> _Described:
        return _Described({"version": "test", "jobs": []})

    def jobs(self) -> list[_Described]:
        return []

    def create_job(self, body: dict[str, Any]) -> _Described:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.served.append(body.get("name", ""))
        try:
            gate = self.gates.get(body.get("name", ""), self.gate)
            if gate is not None:
                gate.wait(30)
            return _Described({"job_id": 1, **body})
        finally:
            with self._lock:
                self.inside -= 1

    def abort(self, job_id: int, body: dict[str, Any] | None = None) -> _Described:
        return _Described({"job_id": job_id, "state": "aborted"})


_LIMITS = Limits(max_connections=16, handler_threads=2, max_body_bytes=4096,
                 header_timeout_s=5.0, idle_timeout_s=5.0, drain_s=1.0)


@pytest.fixture
def appliance() -> _Appliance:
    return _Appliance()


def serving(appliance: _Appliance, limits: Limits = _LIMITS) -> tuple[HttpServer, int]:
    server = HttpServer(limits, name="test")
    _, port = server.listen_tcp(("127.0.0.1", 0), ApiApp(appliance, None))  # type: ignore[arg-type]
    return server, port


@pytest.fixture
def api(appliance: _Appliance) -> Iterator[int]:
    server, port = serving(appliance)
    with server:
        yield port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response off `sock`: status, headers (lower-case names), body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body[:length]


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(port) as sock:
        sock.sendall(raw)
        return answer(sock)


def closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (reads its end of stream, or a reset)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


def test_an_announced_body_over_the_cap_is_refused_from_the_headers_alone(api: int) -> None:
    with connect(api) as sock:
        # 10 MB announced, not one byte of it sent: the answer cannot wait for the body
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n")
        status, headers, body = answer(sock)
        assert status == 413 and "over 4096 bytes" in json.loads(body)["error"]
        assert headers["connection"] == "close"
        assert closed(sock)


@pytest.mark.parametrize(("head", "status", "says"), [
    ("Content-Length: -1\r\n", 400, "Content-Length"),
    ("Content-Length: 12abc\r\n", 400, "Content-Length"),
    ("Content-Length: 5\r\nContent-Length: 6\r\n", 400, "Content-Length"),
    ("", 411, "Content-Length"),  # a body-taking route with no length at all
    ("Transfer-Encoding: chunked\r\n", 411, "chunked"),
    ("Transfer-Encoding: chunked\r\nContent-Length: 10\r\n", 411, "chunked"),
    ("Transfer-Encoding: gzip\r\n", 501, "chunked"),
])
def test_a_body_must_be_announced_plainly(api: int, head: str, status: int, says: str) -> None:
    with connect(api) as sock:
        sock.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: t\r\n{head}\r\n".encode()
                     + b'{"name": "j"}' * 1000)
        got, _, body = answer(sock)
        assert (got, says in json.loads(body)["error"]) == (status, True)
        assert closed(sock)


def test_a_bodiless_post_needs_no_length_and_keeps_the_connection(api: int) -> None:
    with connect(api) as sock:
        for _ in range(3):  # keep-alive: three requests on one connection
            sock.sendall(b"POST /v1/jobs/7/abort HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, body = answer(sock)
            assert (status, json.loads(body)["state"]) == (200, "aborted")


def test_deep_json_is_a_clear_400_and_never_drops_the_connection(api: int) -> None:
    fine = b'{"name": "j", "world_size": 2, "x": ' + b"[" * (MAX_JSON_DEPTH - 1) \
        + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert exchange(api, post("/v1/jobs", fine))[0] == 200
    for deep in (b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
                 b"[" * 2000 + b"]" * 2000):  # 2000: past json's own recursion limit
        status, _, body = exchange(api, post("/v1/jobs", deep))
        assert status == 400
        assert f"deeper than {MAX_JSON_DEPTH}" in json.loads(body)["error"]
    # brackets inside strings are not nesting
    stringy = json.dumps({"name": "[" * 100 + "{" * 100, "world_size": 2}).encode()
    assert exchange(api, post("/v1/jobs", stringy))[0] == 200
    assert exchange(api, post("/v1/jobs", b"\xff\xfe not json"))[0] == 400


def test_a_head_over_the_bound_is_431(api: int) -> None:
    for size in (20000, 200000):  # whole in one read, or arriving over several
        status, _, _ = exchange(api, b"GET /v1/status HTTP/1.1\r\nHost: t\r\nX-Big: "
                                + b"a" * size + b"\r\n\r\n")
        assert status == 431


def test_connections_beyond_the_cap_get_503_and_are_closed(api: int) -> None:
    held = [connect(api) for _ in range(_LIMITS.max_connections)]
    try:
        for sock in held:  # every one is served
            sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n")
            assert answer(sock)[0] == 200
        with connect(api) as extra:
            status, _, body = answer(extra)
            assert status == 503 and "too many connections" in json.loads(body)["error"]
            assert closed(extra)
        held.pop().close()

        def served() -> bool:
            with connect(api) as sock:
                sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n")
                return answer(sock)[0] == 200
        wait_until(served, 10, what="a connection slot freed by a client's close")
    finally:
        for sock in held:
            sock.close()


def test_slow_and_idle_clients_are_timed_out(appliance: _Appliance) -> None:
    limits = Limits(max_connections=16, handler_threads=2, header_timeout_s=0.3,
                    idle_timeout_s=0.6, drain_s=1.0)
    server, port = serving(appliance, limits)
    with server:
        silent, partial, kept = connect(port), connect(port), connect(port)
        partial.sendall(b"GET /v1/sta")
        kept.sendall(b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n")
        assert answer(kept)[0] == 200
        started = time.monotonic()
        assert closed(silent)  # no request at all within the header timeout
        status, _, body = answer(partial)  # half a head: told why
        assert status == 408 and "0.3 s" in json.loads(body)["error"]
        assert closed(kept)  # kept alive, then idle past the idle timeout
        assert time.monotonic() - started < 3
        for sock in (silent, partial, kept):
            sock.close()
        wait_until(lambda: server.connections == 0, 5, what="the server to forget them")


def test_handlers_are_bounded_by_the_pool(appliance: _Appliance) -> None:
    appliance.gate = threading.Event()
    server, port = serving(appliance)
    body = b'{"name": "j", "world_size": 2}'
    with server:
        socks = [connect(port) for _ in range(6)]
        try:
            for sock in socks:
                sock.sendall(post("/v1/jobs", body))
            wait_until(lambda: appliance.inside == _LIMITS.handler_threads, 10,
                       what="the pool's threads all busy")
            handlers = [t for t in threading.enumerate() if t.name.startswith("test-handler")]
            assert len(handlers) == _LIMITS.handler_threads
            # the loop still answers from the head alone while every handler is blocked
            assert exchange(port, b"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 404
            appliance.gate.set()
            assert [answer(s)[0] for s in socks] == [200] * 6
            assert appliance.most_inside == _LIMITS.handler_threads
        finally:
            for sock in socks:
                sock.close()


def test_a_request_whose_client_left_before_its_turn_is_not_served(appliance: _Appliance) -> None:
    """Thousands of ranks joining at once queue longer than an attempt waits; each attempt
    that gave up closes its connection and asks again. Serving those queued requests anyway
    only delays the ones still wanted."""
    appliance.gates["busy"] = threading.Event()
    server, port = serving(appliance)
    with server:
        busy = [connect(port) for _ in range(_LIMITS.handler_threads)]
        try:
            for sock in busy:
                sock.sendall(post("/v1/jobs", b'{"name": "busy", "world_size": 2}'))
            wait_until(lambda: appliance.inside == _LIMITS.handler_threads, 10,
                       what="every handler busy")
            with connect(port) as gone:
                gone.sendall(post("/v1/jobs", b'{"name": "gone", "world_size": 2}'))
            # (the loop reads the closed end before it answers a later connection)
            assert exchange(port, b"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 404
            with connect(port) as kept:
                kept.sendall(post("/v1/jobs", b'{"name": "kept", "world_size": 2}'))
                appliance.gates["busy"].set()
                assert [answer(s)[0] for s in busy] == [200, 200]
                assert answer(kept)[0] == 200
            assert sorted(appliance.served) == ["busy", "busy", "kept"]
            assert server.abandoned == 1
        finally:
            for sock in busy:
                sock.close()


def test_unix_and_metrics_listeners_share_the_server(appliance: _Appliance,
                                                     tmp_path: Path) -> None:
    server = HttpServer(_LIMITS, name="test")
    path = server.listen_unix(str(tmp_path / "api.sock"), ApiApp(appliance, None))  # type: ignore[arg-type]
    _, metrics = server.listen_tcp(("127.0.0.1", 0), MetricsApp(appliance))  # type: ignore[arg-type]
    _, api = server.listen_tcp(("127.0.0.1", 0), ApiApp(appliance, "s" * 16))  # type: ignore[arg-type]
    with server:
        assert UnixApi(path).get("/v1/status")["version"] == "test"
        assert exchange(metrics, b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 404
        assert exchange(api, b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 401
        authorised = (f"GET /v1/status HTTP/1.1\r\nHost: t\r\n"
                      f"Authorization: Bearer {'s' * 16}\r\n\r\n")
        assert exchange(api, authorised.encode())[0] == 200
        # one connection cap over every listener
        held = [connect(api) for _ in range(_LIMITS.max_connections)]
        wait_until(lambda: server.connections == _LIMITS.max_connections, 10,
                   what="every connection accepted")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(path)
                assert answer(sock)[0] == 503
            with pytest.raises(ApiError) as refused:  # what reductionctl then says
                UnixApi(path).get("/v1/status")
            assert refused.value.status == 503 and "too many connections" in str(refused.value)
        finally:
            for sock in held:
                sock.close()
    assert not Path(path).exists()


def test_an_answer_sent_before_the_request_was_read_still_reaches_the_client(
        tmp_path: Path) -> None:
    """At its connection cap the server answers 503 and closes without reading the request;
    the client's send then fails (EPIPE), but the answer is in its socket and says why (seen in
    CI: "cannot reach reductiond ... BrokenPipeError" instead of the 503)."""
    path = str(tmp_path / "api.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)

        def answer_and_close() -> None:
            conn, _ = listener.accept()
            with conn:
                body = b'{"error": "too many connections; retry later"}'
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                             b"application/json\r\nContent-Length: " + str(len(body)).encode()
                             + b"\r\nConnection: close\r\n\r\n" + body)

        server = threading.Thread(target=answer_and_close)
        server.start()
        try:
            with pytest.raises(ApiError) as refused:
                # larger than the socket's buffers: the send cannot finish before the close
                UnixApi(path, timeout_s=10).request("POST", "/v1/jobs", {"pad": "x" * 2**22})
        finally:
            server.join()
    assert refused.value.status == 503 and "too many connections" in str(refused.value)


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_reset_is_at_most_one_line_and_never_a_traceback(
        appliance: _Appliance, caplog: pytest.LogCaptureFixture) -> None:
    appliance.gate = threading.Event()
    server, port = serving(appliance)
    with server, caplog.at_level(logging.DEBUG, logger="reductiond"):
        halfway = connect(port)
        halfway.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
        _reset(halfway)  # in the middle of a body
        waiting = connect(port)
        waiting.sendall(post("/v1/jobs", b'{"name": "j", "world_size": 2}'))
        wait_until(lambda: appliance.inside == 1, 10, what="the request in its handler")
        _reset(waiting)  # before its answer
        appliance.gate.set()
        wait_until(lambda: server.connections == 0, 10, what="both connections gone")
        assert exchange(port, b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 200
    records = [r for r in caplog.records if r.name.startswith("reductiond")]
    assert len(records) <= 2, [r.getMessage() for r in records]  # one per reset at most
    assert all(r.exc_info is None and r.levelno <= logging.DEBUG for r in records), records


def test_stop_answers_in_flight_closes_idle_and_keeps_its_bound(appliance: _Appliance) -> None:
    quick, never = threading.Event(), threading.Event()
    appliance.gates = {"quick": quick, "never": never}
    server, port = serving(appliance)
    server.start()
    idle = [connect(port) for _ in range(5)]
    busy, stuck = connect(port), connect(port)
    busy.sendall(post("/v1/jobs", b'{"name": "quick", "world_size": 2}'))
    stuck.sendall(post("/v1/jobs", b'{"name": "never", "world_size": 2}'))
    wait_until(lambda: appliance.inside == 2, 10, what="both requests in their handlers")
    threading.Timer(0.2, quick.set).start()  # finishes within the drain; `never` does not
    started = time.monotonic()
    try:
        server.stop()
        took = time.monotonic() - started
        assert 0.2 <= took < _LIMITS.drain_s + 1.5
        status, headers, _ = answer(busy)  # answered, and told the connection ends
        assert (status, headers["connection"]) == (200, "close")
        assert closed(stuck)  # cut at the drain's end, unanswered
        assert all(closed(s) for s in idle)
        with pytest.raises(ConnectionRefusedError):
            connect(port)
    finally:
        never.set()
        for sock in (*idle, busy, stuck):
            sock.close()


def test_a_stopped_server_holding_its_ports_is_never_refused_until_it_lets_go(
        appliance: _Appliance) -> None:
    """The daemon holds the API's TCP ports while it tells the jobs' workers it stops: a worker
    that tries a connection meanwhile (plugin.silence) must not take a refusal for a dead
    reductiond. Connections wait unanswered; once it lets go, they are refused."""
    server, port = serving(appliance)
    server.start()
    with server.tcp_ports_held():
        server.stop()
        waiting = connect(port)  # (the kernel's handshake: nothing accepts it)
        waiting.sendall(post("/v1/jobs", b'{"name": "late", "world_size": 2}'))
        waiting.settimeout(0.3)
        with pytest.raises(TimeoutError):  # unanswered while held
            waiting.recv(1)
    waiting.settimeout(5)
    with pytest.raises(ConnectionResetError):  # let go: the queued connection is reset
        waiting.recv(1)
    waiting.close()
    with pytest.raises(ConnectionRefusedError):
        connect(port)


def test_no_daemon_behind_the_socket_is_said_with_what_to_check(tmp_path: Path) -> None:
    """`reductionctl status` with no reductiond (or one on another socket) said only
    "FileNotFoundError: [Errno 2] No such file or directory"."""
    gone = tmp_path / "api.sock"
    with pytest.raises(ApiError, match=r"FileNotFoundError.*is reductiond running\?"):
        UnixApi(str(gone)).get("/v1/status")
    with socket.socket(socket.AF_UNIX) as stale:  # a socket file its daemon left: refused
        stale.bind(str(gone))
    with pytest.raises(ApiError, match=r"ConnectionRefusedError.*give --socket or --config"):
        UnixApi(str(gone)).get("/v1/status")
