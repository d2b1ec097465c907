"""Integrity and isolation on the emulated rack, each break of the integrity report reproduced
against a real reductiond and real workers: forged contributions and results, a second process
claiming a rank, a round 2**32-1 flood, a worker killed and restarted, a deterministic job
pinning receive buffers, and forged datagrams re-pointing unicast results."""

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
from collections.abc import Iterator
from pathlib import Path
from statistics import median
from typing import Any

import pytest

from reduction_appliance.deploy.testnet.harness import (
    ApplianceProcess,
    LabNetwork,
    start_appliance,
)

pytestmark = pytest.mark.slow  # real daemons and worker processes: seconds each

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


@pytest.fixture
def rack() -> Iterator[tuple[LabNetwork, ApplianceProcess]]:
    with LabNetwork.rack(4) as net, start_appliance(net, cores=2) as appliance:
        yield net, appliance


def test_forged_contributions_and_results_change_no_sum(
        rack: tuple[LabNetwork, ApplianceProcess]) -> None:
    net, appliance = rack
    job = Job(net, appliance, "victim", 3)
    try:
        group, port = job.joined[0]["multicast"]
        forger = attacker(net, 3, "contribute", group, str(port), "1", "600")
        resulter = attacker(net, 3, "results", group, str(port), "600")
        during = job.run(150)  # the attackers sniff this job's results and strike during it
        forged = report_of(forger)
        results = report_of(resulter)
        assert forged["cookie_learned"] and results["cookie_learned"]  # the cookie leaks...
        assert all_exact(during) and all_exact(job.run(5))  # ... and changes no sum
        counters = appliance.counters()
        assert counters["drop_bad_source"] >= forged["sent"]
        assert sum(r["rejected"] for r in during) > 0  # forged results reached the workers
        assert counters["drop_mismatch"] == 0
    finally:
        job.close()


def test_a_second_process_claiming_a_rank_is_refused_at_join(
        rack: tuple[LabNetwork, ApplianceProcess]) -> None:
    net, appliance = rack
    job = Job(net, appliance, "pair", 2)
    try:
        imposter = Steered(net, 2, [*job.argv(1)[:-2], "--local", net.worker_address(2)])
        refused = imposter.next()
        assert refused.get("error") == "RendezvousError", refused
        text = refused["message"]
        assert "409" in text and "rank 1" in text
        assert net.worker_address(1) in text and net.worker_address(2) in text
        imposter.proc.wait(timeout=30)
        assert all_exact(job.run(5))
    finally:
        job.close()


def test_a_far_future_flood_is_counted_and_the_job_keeps_working(
        rack: tuple[LabNetwork, ApplianceProcess]) -> None:
    net, appliance = rack
    job = Job(net, appliance, "flooded", 3)
    try:
        group, port = job.joined[0]["multicast"]
        host, rank_port = job.joined[1]["source"]
        own = attacker(net, 3, "far", group, str(port), "1", "64")
        # The same flood with rank 1's own address forged (a raw socket in rank 1's host).
        spoofed = attacker(net, 1, "far", group, str(port), "1", "64", f"{host}:{rank_port}")
        assert all_exact(job.run(50))
        assert report_of(own)["sent"] == 64 and report_of(spoofed)["sent"] == 64
        counters = appliance.counters()
        assert counters["drop_bad_source"] >= 64
        assert counters["drop_window"] >= 64  # out of the window: never occupied a slot
        assert all_exact(job.run(5))
    finally:
        job.close()


def test_a_killed_worker_rejoins_and_the_next_allreduces_are_exact(
        rack: tuple[LabNetwork, ApplianceProcess]) -> None:
    net, appliance = rack
    job = Job(net, appliance, "restart", 3)
    try:
        assert all_exact(job.run(3))
        job.ranks[2].kill()
        again = job.start(2, "--rejoin")
        joined = again.next()
        assert joined.get("joined") == 2 and joined["epoch"] == 2, joined
        job.ranks[2] = again
        after = job.run(5)
        assert all_exact(after)
        assert [r["epoch"] for r in after] == [2, 2, 2]
        assert appliance.counters()["job_notices"] >= 2  # the survivors were told (RESYNC)
    finally:
        job.close()


def test_a_job_pinning_receive_buffers_does_not_starve_another(
        rack: tuple[LabNetwork, ApplianceProcess]) -> None:
    net, appliance = rack
    quiet_job = Job(net, appliance, "quiet", 2, "--deterministic")
    greedy = None
    try:
        quiet = median(t for r in quiet_job.run(20, 1 << 20) for t in r["times"])
        # A deterministic job of 64 ranks whose rank 0 never comes: 63 ranks x 32 slots x 2
        # cores = 4032 early contributions, each wanting a held buffer.
        greedy = net.popen_worker(2, [sys.executable, str(HERE / "attacker.py"), "hold",
                                      appliance.api, "greedy", "greedy-secret", "64", "32"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert greedy.stdout is not None
        held = json.loads(greedy.stdout.readline())
        assert held["sent"] == 2 * 63 * 32 * 2
        reports = quiet_job.run(20, 1 << 20)
        assert all_exact(reports)
        loaded = median(t for r in reports for t in r["times"])
        assert loaded < 2 * quiet, (quiet, loaded)
        assert appliance.counters()["drop_no_buffer"] > 0  # the greedy job hit its quota
    finally:
        if greedy is not None:
            greedy.communicate(timeout=30)
        quiet_job.close()


def test_unicast_results_are_not_re_pointed_by_forged_datagrams(
        rack: tuple[LabNetwork, ApplianceProcess]) -> None:
    net, appliance = rack
    job = Job(net, appliance, "unicast", 2, "--unicast")
    try:
        first = job.joined[0]
        core = appliance.status()["cores"][0]["port"]
        # Even with the cookie leaked, forged contributions from another host re-point nothing.
        thief = attacker(net, 3, "leaked", net.appliance_address(0), str(core),
                         str(first["job_id"]), str(first["cookie"]), str(first["epoch"]), "1",
                         "400")
        assert all_exact(job.run(100))
        stolen = report_of(thief)
        assert stolen["received"] == 0, stolen
        assert appliance.counters()["drop_bad_source"] >= 400
        assert all_exact(job.run(5))
    finally:
        job.close()
