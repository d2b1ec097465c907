"""Steered workers on the emulated rack: each rank a real worker process (steered_worker.py)
the test drives line by line, and the attacker program (attacker.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from reduction_appliance.deploy.testnet.harness import ApplianceProcess, LabNetwork
from tests.waiting import wait_until

HERE = Path(__file__).resolve().parent
SIZE = 64 * 1024


class Steered:
    """A steered worker (steered_worker.py) on a host of the rack; reads its JSON lines."""

    def __init__(self, net: LabNetwork, host: int, argv: list[str]) -> None:
        self.proc = net.popen_worker(host, [sys.executable, str(HERE / "steered_worker.py"),
                                            *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def next(self, timeout: float = 120.0) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr \
                else "(still running)"
            raise AssertionError(f"no line from the worker within {timeout:g} s: {err}") from None

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def quit(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.send("quit")
            self.proc.wait(timeout=30)


class Job:
    """The ranks of one job, each on its own host of the rack."""

    def __init__(self, net: LabNetwork, appliance: ApplianceProcess, name: str, world: int,
                 *options: str, hosts: list[int] | None = None) -> None:
        self.net, self.appliance, self.name, self.world = net, appliance, name, world
        self.options = options
        self.secret = secrets.token_urlsafe(12)
        self.hosts = hosts or list(range(world))
        self.ranks = [self.start(rank) for rank in range(world)]
        self.joined = [r.next() for r in self.ranks]
        for line in self.joined:
            assert "joined" in line, line

    def argv(self, rank: int, *extra: str) -> list[str]:
        return ["--appliance", self.appliance.api, "--job", self.name, f"--secret={self.secret}",
                "--world", str(self.world), "--rank", str(rank),
                "--local", self.net.worker_address(self.hosts[rank]), *self.options, *extra]

    def start(self, rank: int, *extra: str) -> Steered:
        return Steered(self.net, self.hosts[rank], self.argv(rank, *extra))

    def run(self, count: int, size: int = SIZE) -> list[dict[str, Any]]:
        for r in self.ranks:
            r.send(f"run {count} {size}")
        return [r.next() for r in self.ranks]

    def close(self) -> None:
        for r in self.ranks:
            r.quit()


def start_a_long_run(job: Job, appliance: ApplianceProcess, size: int = 1 << 20) -> None:
    """Every rank starts a run long enough to be cut in the middle; returns once it is under
    way (the appliance is reducing)."""
    for rank in job.ranks:
        rank.send(f"run 1000 {size}")
    reduced = appliance.counters()["segments_reduced"]
    wait_until(lambda: appliance.counters()["segments_reduced"] > reduced + 100, 30,
               what="the long run under way")


def all_exact(reports: list[dict[str, Any]]) -> bool:
    return all(r["exact"] == r["ran"] and r["errors"] == 0 for r in reports)


def attacker(net: LabNetwork, host: int, *argv: str) -> subprocess.Popen[str]:
    """Start the attacker; a sniffing one is returned once it listens to the group."""
    proc = net.popen_worker(host, [sys.executable, str(HERE / "attacker.py"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if argv[0] in ("sniff", "contribute", "results", "far"):
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening" in line, (line, proc.stderr.read() if proc.stderr else "")
    return proc


def report_of(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return dict(json.loads(out.strip().splitlines()[-1]))
