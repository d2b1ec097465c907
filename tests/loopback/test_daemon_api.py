"""The real reductiond's API under hostile clients, on the host's loopback (no root): bodies
that would grow its memory, thousands of idle connections, resets, SIGTERM with connections
open, and sd_notify to a datagram socket standing in for systemd.

Each test starts its own daemon on free ports (never the lab's fixed 7070), so they can run
beside other tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reduction_appliance.control.config import parse, to_toml
from reduction_appliance.control.daemon import DRAIN_GRACE_S
from reduction_appliance.deploy.testnet.harness import DAEMON, OutputTail
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # a real daemon and its data-plane process each: seconds

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Daemon:
    process: subprocess.Popen[str]
    api: tuple[str, int]
    unix_socket: str
    stdout: OutputTail
    stderr: OutputTail

    @property
    def pid(self) -> int:
        return self.process.pid

    def get(self, path: str) -> Any:
        url = f"http://{self.api[0]}:{self.api[1]}{path}"
        with _DIRECT.open(url, timeout=10) as reply:
            return json.loads(reply.read())


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_daemon(api: dict[str, Any] | None = None,
                   env: dict[str, str] | None = None) -> Iterator[Daemon]:
    """reductiond with one numpy core, its API on a free loopback port, until the block ends
    (then SIGKILL to its process group if it still runs)."""
    tmp = tempfile.mkdtemp(prefix="rd-")  # short: a Unix socket path has 108 bytes
    try:
        sock = str(Path(tmp) / "api.sock")
        cfg = parse({"dataplane": {"address": "127.0.0.1", "base_port": _free_udp_port(),
                                   "kernels": "numpy", "slot_memory_mb": 4, "mtu": 9000},
                     "multicast": {"enabled": False},
                     "api": {"listen": "127.0.0.1:0", "unix_socket": sock, **(api or {})}})
        path = Path(tmp) / "appliance.toml"
        path.write_text(to_toml(cfg))
        proc = subprocess.Popen([sys.executable, *DAEMON, "--config", str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        out, err = OutputTail(proc.stdout, marker="reductiond ready"), OutputTail(proc.stderr)
        try:
            assert out.seen.wait(60) and out.line, f"not ready: {err.text()}"
            found = re.search(r"api ([\d.]+):(\d+)", out.line)
            assert found, out.line
            yield Daemon(proc, (found.group(1), int(found.group(2))), sock, out, err)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _accepted(pid: int, api_port: int, client_ports: set[int]) -> int:
    """How many of the connections from `client_ports` to `api_port` the daemon `pid` has
    accepted: an established IPv4 socket whose inode is one of its file descriptors. Counting
    the daemon's descriptors instead races with the close of a connection a moment earlier."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    accepted = 0
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if local_port == api_port and remote_port in client_ports and int(fields[9]) in inodes:
            accepted += 1
    return accepted


def _connections(daemon: Daemon, count: int) -> list[socket.socket]:
    """`count` idle TCP connections to the API, each accepted by the daemon."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 1024)), hard))
    socks = [socket.create_connection(daemon.api, timeout=10) for _ in range(count)]
    ports = {sock.getsockname()[1] for sock in socks}
    try:
        wait_until(lambda: _accepted(daemon.pid, daemon.api[1], ports) == count, 30,
                   what=f"the daemon to accept {count} connections")
    except TimeoutError as error:
        raise AssertionError(
            f"{error}: {_accepted(daemon.pid, daemon.api[1], ports)} accepted, daemon has "
            f"{len(os.listdir(f'/proc/{daemon.pid}/fd'))} files open; its log:\n"
            f"{daemon.stderr.text()}") from None
    return socks


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _ended(sock: socket.socket) -> bool:
    """The server closed `sock`: end of stream or a reset, after nothing or a 503 (a
    connection accepted as the drain began is answered that way)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data == b"" or data.startswith(b"HTTP/1.1 503 ")


def test_body_caps_are_answered_from_the_headers_and_peak_rss_stays(
        capsys: pytest.CaptureFixture[str]) -> None:
    with running_daemon({"max_body_bytes": 65536}) as daemon:
        # Reset the peak (Linux >= 4.0: "5" to clear_refs), so VmHWM measures from here on.
        with contextlib.suppress(OSError):
            Path(f"/proc/{daemon.pid}/clear_refs").write_text("5")
        before = _proc_status(daemon.pid, "VmHWM")
        with socket.create_connection(daemon.api, timeout=10) as sock:
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: a\r\nContent-Length: 10000000\r\n\r\n")
            status, body = _answer(sock)  # not a byte of the 10 MB was sent
            assert status == 413 and b"over 65536 bytes" in body
        with socket.create_connection(daemon.api, timeout=10) as sock:
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n")
            sent = 0

            def flood() -> None:  # what a server reading "to the end" would keep
                nonlocal sent
                with contextlib.suppress(OSError):
                    while sent < 64 << 20:
                        sent += sock.send(b"x" * 65536)
            flooder = threading.Thread(target=flood)
            flooder.start()
            status, body = _answer(sock)
            assert status == 400 and b"Content-Length" in body
            flooder.join(30)
        status = daemon.get("/v1/status")
        assert status["janitor_errors"] == 0  # and it still serves
        assert (status["segment_bytes"], status["segment_origin"]) == (8896, "MTU 9000")
        after = _proc_status(daemon.pid, "VmHWM")
        with capsys.disabled():
            print(f"\nVmHWM before {before} kB, after {after} kB "
                  f"({sent / 2**20:.1f} MiB sent behind Content-Length: -1)")
        assert after - before < 5 * 1024


def test_2000_idle_connections_cost_no_threads_and_status_stays_fast(
        capsys: pytest.CaptureFixture[str]) -> None:
    with running_daemon({"header_timeout_s": 120.0, "idle_timeout_s": 120.0}) as daemon:
        daemon.get("/v1/status")
        threads_before = _threads(daemon.pid)
        socks = _connections(daemon, 2000)
        try:
            threads_after = _threads(daemon.pid)
            latencies = []
            for _ in range(5):
                started = time.perf_counter()
                status = daemon.get("/v1/status")
                latencies.append(time.perf_counter() - started)
                assert status["version"]
            unix_ok = subprocess.run(
                [sys.executable, "-m", "reduction_appliance.control.cli", "status", "--json",
                 "--socket", daemon.unix_socket], capture_output=True, text=True, timeout=60)
        finally:
            for sock in socks:
                sock.close()
        with capsys.disabled():
            print(f"\nthreads {threads_before} -> {threads_after} with 2000 idle connections; "
                  f"GET /v1/status {', '.join(f'{t * 1000:.1f}' for t in latencies)} ms")
        assert threads_after <= threads_before
        assert statistics.median(latencies) < 0.1
        assert unix_ok.returncode == 0, unix_ok.stderr


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_resets_log_at_most_a_line_each_and_no_traceback() -> None:
    with running_daemon() as daemon:
        base_fds = _fds(daemon.pid)
        logged = daemon.stderr.text()
        kinds = [b"GET /v1/sta",  # half a head
                 b"POST /v1/jobs HTTP/1.1\r\nHost: a\r\nContent-Length: 50\r\n\r\n{",  # half a body
                 b"GET /v1/status HTTP/1.1\r\nHost: a\r\n\r\n"]  # a whole request, unread
        for raw in kinds * 20:
            sock = socket.create_connection(daemon.api, timeout=10)
            sock.sendall(raw)
            _reset(sock)
        wait_until(lambda: _fds(daemon.pid) <= base_fds, 30, what="every reset connection gone")
        assert daemon.get("/v1/status")["version"]
        new = daemon.stderr.text()[len(logged):]
        assert "Traceback" not in new
        assert len(new.splitlines()) <= len(kinds) * 20, new


def test_sigterm_with_1000_open_connections_exits_within_the_drain_bound(
        capsys: pytest.CaptureFixture[str]) -> None:
    drain_s = 2.0
    # The bound: api.drain_s for requests in flight, DRAIN_GRACE_S for running rounds (none
    # here), and 5 s for the cores' stop and the interpreter's exit.
    bound_s = drain_s + DRAIN_GRACE_S + 5.0
    with running_daemon({"drain_s": drain_s, "header_timeout_s": 120.0,
                         "idle_timeout_s": 120.0}) as daemon:
        socks = _connections(daemon, 1000)
        busy = socks[0]  # one mid-request: half a head, never finished
        busy.sendall(b"GET /v1/status HTTP/1.1\r\n")
        daemon.get("/v1/status")  # a round trip after it: the daemon has read the half head
        try:
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGTERM)
            code = daemon.process.wait(timeout=bound_s + 10)
            took = time.monotonic() - started
            assert all(_ended(s) for s in socks)  # closed, not left hanging
        finally:
            for sock in socks:
                sock.close()
        daemon.stderr.join()
        with capsys.disabled():
            print(f"\nSIGTERM with 1000 connections open: exited {code} in {took:.2f} s "
                  f"(bound {bound_s:g} s)")
        assert code == 0, daemon.stderr.text()
        assert took < bound_s
        assert "Traceback" not in daemon.stderr.text()


def test_sighup_is_said_and_ignored() -> None:
    """SIGHUP's default (a closed terminal, a log rotation's `kill -HUP`) ended the daemon
    at once, every job cut off without a drain."""
    with running_daemon() as daemon:
        daemon.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP ignored" in daemon.stderr.text(), 10, what="the warning")
        assert daemon.process.poll() is None
        assert daemon.get("/v1/status")["cores"]  # still serving
        assert ("SIGHUP ignored: reductiond does not reload its config; restart it (SIGTERM "
                "drains the jobs) to apply a new one") in daemon.stderr.text()


def test_sd_notify_ready_watchdog_and_stopping() -> None:
    name = f"rd-notify-{os.getpid()}-{threading.get_ident()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind("\0" + name)  # abstract, as systemd's own @-names
        systemd.settimeout(60)
        env = {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000"}
        with running_daemon(env=env) as daemon:
            first = systemd.recv(4096).decode()
            assert first.startswith("READY=1\n") and f"MAINPID={daemon.pid}" in first
            assert "STATUS=reductiond ready" in first
            seen = {systemd.recv(4096).decode() for _ in range(2)}
            assert seen == {"WATCHDOG=1"}  # every half WATCHDOG_USEC, from the loop
            daemon.process.send_signal(signal.SIGTERM)
            while (message := systemd.recv(4096).decode()) == "WATCHDOG=1":
                pass
            assert message == "STOPPING=1"
            assert daemon.process.wait(timeout=30) == 0


def _call(daemon: Daemon, method: str, path: str, body: dict[str, Any] | None = None) -> int:
    """The status code of one request (errors included), its body read and dropped."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{daemon.api[0]}:{daemon.api[1]}{path}", data=data,
                                     method=method, headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(request, timeout=10) as reply:
            reply.read()
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def test_listings_under_churn_never_404() -> None:
    with running_daemon() as daemon:
        churned = threading.Event()
        churn_codes: list[int] = []

        def churn() -> None:
            try:
                for i in range(150):
                    job = _post_job(daemon, f"churn-{i}")
                    churn_codes.append(_call(daemon, "DELETE", f"/v1/jobs/{job}"))
            finally:
                churned.set()

        worker = threading.Thread(target=churn)
        worker.start()
        listings: dict[str, list[int]] = {"/v1/jobs": [], "/v1/status": []}
        while not churned.is_set():
            for path, codes in listings.items():
                codes.append(_call(daemon, "GET", path))
        worker.join()
        assert churn_codes == [200] * 150
        for path, codes in listings.items():
            assert len(codes) > 10 and set(codes) == {200}, (path, sorted(set(codes)))


def _post_job(daemon: Daemon, name: str) -> int:
    data = json.dumps({"name": name, "world_size": 2}).encode()
    request = urllib.request.Request(f"http://{daemon.api[0]}:{daemon.api[1]}/v1/jobs",
                                     data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    with _DIRECT.open(request, timeout=10) as reply:
        return int(json.loads(reply.read())["job_id"])
