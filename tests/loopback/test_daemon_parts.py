"""reductiond's pieces that need no data plane: sd_notify on a real datagram socket, the
janitor that must never kill the daemon, the open-files limit, how status shows the
janitor's failures, the harness draining a daemon's output, and a start refused for a port
in use."""

from __future__ import annotations

import logging
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from reduction_appliance.control import daemon
from reduction_appliance.control.ctl import render_status
from reduction_appliance.control.daemon import Janitor, raise_open_files_limit, sd_notify
from reduction_appliance.control.jobtext import held_windows, losses, render_job, shared_hosts
from reduction_appliance.dataplane.errors import Unavailable
from reduction_appliance.deploy.testnet.harness import OutputTail


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_reaches_a_datagram_socket(abstract: bool, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        if abstract:
            name = f"rd-parts-{os.getpid()}"
            systemd.bind("\0" + name)
            monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        else:
            path = str(tmp_path / "notify")
            systemd.bind(path)
            monkeypatch.setenv("NOTIFY_SOCKET", path)
        systemd.settimeout(5)
        assert sd_notify("READY=1\nSTATUS=serving")
        assert systemd.recv(4096) == b"READY=1\nSTATUS=serving"


def test_sd_notify_is_a_no_op_without_systemd_and_one_line_when_it_fails(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sd_notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody"))
    with caplog.at_level(logging.INFO, logger="reductiond"):
        assert not sd_notify("READY=1")
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is None


def test_the_watchdog_interval_is_half_of_watchdog_usec(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert daemon._watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert daemon._watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert daemon._watchdog_interval_s() is None


class _Broken:
    """An Appliance whose chores fail the way a test says."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.evicted = 0
        self.probed = 0

    def probe_cores(self) -> None:
        self.probed += 1

    def sample_rates(self) -> None:
        if self.error is not None:
            raise self.error

    def evict_idle(self) -> list[Any]:
        self.evicted += 1
        return []


def test_the_janitor_logs_counts_and_carries_on(caplog: pytest.LogCaptureFixture) -> None:
    broken = _Broken(ZeroDivisionError("rates of nothing"))
    failures: list[int] = []
    janitor = Janitor(broken, lambda: failures.append(1))  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="reductiond"):
        for _ in range(3):
            janitor.tick()  # never raises
    assert len(failures) == 3 and broken.evicted == broken.probed == 3  # the others still ran
    assert len(caplog.records) == 3  # one line per failure, no traceback
    assert all(r.exc_info is None and "ZeroDivisionError: rates of nothing" in r.getMessage()
               and "\n" not in r.getMessage() for r in caplog.records)
    caplog.clear()
    broken.error = Unavailable("core 0 is restarting")  # not a failure: it passes
    with caplog.at_level(logging.INFO, logger="reductiond"):
        janitor.tick()
    assert len(failures) == 3 and caplog.records == []


def test_status_shows_the_janitors_failures() -> None:
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "jobs": [], "interfaces": [], "steering": [], "steering_notes": [],
                "rdma_devices": [], "janitor_errors": 0}
    assert "janitor" not in render_status(snapshot)
    shown = render_status(snapshot | {"janitor_errors": 4})
    assert "janitor: 4 periodic chore(s) failed" in shown.split("\n\n")[0]
    assert shown.split("\n\n")[2] == "jobs: none"  # `reductionctl jobs` still finds its part
    assert "api:" not in shown
    shown = render_status(snapshot | {"api_requests_abandoned": 37})
    assert "api: 37 request(s) not served since start" in shown.split("\n\n")[0]
    quiet = render_status(snapshot | {"jobs_evicted": {"idle": 0, "abandoned": 0}})
    assert "evicted" not in quiet
    shown = render_status(snapshot | {"jobs_evicted": {"idle": 1, "abandoned": 2}})
    assert shown.split("\n\n")[2] == (
        "jobs: none\njobs evicted since start: 2 abandoned, 1 idle (the log says which)")


def test_the_open_files_limit_is_raised_to_the_hard_limit(
        caplog: pytest.LogCaptureFixture) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 1024:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        with caplog.at_level(logging.INFO, logger="reductiond"):
            now = raise_open_files_limit()
        assert now == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert now == hard
        assert [r.levelname for r in caplog.records] == ["INFO"]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_harness_drains_a_chatty_child_and_keeps_its_tail() -> None:
    # More than a pipe holds (64 KiB) on both pipes before the ready line: an undrained
    # child would block in its writes and never get there.
    chatty = ("import sys\n"
              "for i in range(20000): print(f'out {i:08}', flush=False); "
              "print(f'err {i:08}', file=sys.stderr)\n"
              "print('reductiond ready: yes', flush=True)\n"
              "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", chatty], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = OutputTail(proc.stdout, marker="reductiond ready")
        err = OutputTail(proc.stderr, limit=4096)
        assert out.seen.wait(60) and out.line == "reductiond ready: yes\n"
        assert proc.poll() is None  # not blocked, not dead: waiting on its stdin
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    err.join()
    assert err.done and err.text().endswith("err 00019999\n")
    assert len(err.text()) <= 4096


def test_status_shows_the_segment_size_and_where_it_came_from() -> None:
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "jobs": [], "interfaces": [], "steering": [], "steering_notes": [],
                "rdma_devices": [], "janitor_errors": 0, "segment_bytes": 8896,
                "segment_origin": "MTU 9000 of interface eth1, which holds 198.18.0.1"}
    shown = render_status(snapshot)
    assert shown.split("\n\n")[0].splitlines()[1] == (
        "UDP segments of 8896 bytes (MTU 9000 of interface eth1, which holds 198.18.0.1)")
    assert shown.split("\n\n")[2] == "jobs: none"


def test_status_names_jobs_whole_where_they_differ_only_at_the_end() -> None:
    """A job's process groups and hook states share its name up to a suffix (.pg1, .hook0):
    the column widens to the longest name (to 40), and a longer one keeps both ends."""
    def job(job_id: int, name: str) -> dict[str, object]:
        return {"job_id": job_id, "name": name, "state": "active", "world_size": 2,
                "joined": [0, 1], "epoch": 1, "rounds": 0, "bytes_reduced": 0,
                "last_activity_s": None, "lagging": {}}
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "interfaces": [], "steering": [], "steering_notes": [], "rdma_devices": [],
                "jobs": [job(1, "resnet50-run-42"), job(2, "resnet50-run-42.pg1"),
                         job(3, "resnet50-run-42.rank1.hook0"), job(4, "x" * 60 + ".pg7")]}
    rows = render_status(snapshot).split("\n\n")[2].splitlines()
    assert rows[0].startswith(" job name" + " " * 37 + "state")  # 40 wide
    assert [r.split()[1] for r in rows[1:]] == [
        "resnet50-run-42", "resnet50-run-42.pg1", "resnet50-run-42.rank1.hook0",
        "x" * 19 + "~" + "x" * 16 + ".pg7"]
    narrow = render_status(snapshot | {"jobs": [job(1, "bert")]}).split("\n\n")[2]
    assert narrow.splitlines()[1].startswith("   1 bert             active")  # 16 as before


def test_status_names_a_rank_whose_datagrams_come_from_elsewhere() -> None:
    job = {"job_id": 3, "name": "behind-nat", "state": "active", "world_size": 2,
           "joined": [0, 1], "epoch": 1, "rounds": 0, "bytes_reduced": 0,
           "last_activity_s": None, "lagging": {}, "endpoints": {"1": "172.17.0.2:40000"},
           "seen_elsewhere": {"1": "10.0.0.5:32768"}}
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "interfaces": [], "steering": [], "steering_notes": [], "rdma_devices": [],
                "jobs": [job]}
    assert ("     ! rank 1 (172.17.0.2:40000): its datagrams came from 10.0.0.5:32768 (a NAT "
            "between it and the appliance?), dropped") in render_status(snapshot).splitlines()


def test_status_names_a_rank_that_loses_datagrams() -> None:
    """One bad cable in a rack: every round waits for its repairs. The status names its rank
    once its share of loss passes LOSSY_SHARE; a rank that lost a datagram or two is not."""
    job = {"job_id": 3, "name": "resnet", "state": "active", "world_size": 4,
           "joined": [0, 1, 2, 3], "epoch": 1, "rounds": 12, "bytes_reduced": 0,
           "last_activity_s": 0.1, "lagging": {}, "endpoints": {"3": "198.18.0.104:40000"},
           "segments_reduced": 1000, "contributions_missed": {"0": 2, "3": 51},
           "results_lost": {"3": 80}}
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "interfaces": [], "steering": [], "steering_notes": [], "rdma_devices": [],
                "jobs": [job]}
    named = [line for line in render_status(snapshot).splitlines() if "loses" in line]
    assert named == ["     ! rank 3 (198.18.0.104:40000) loses datagrams: 51 contributions never "
                     "came (5.1%), 80 results lost on the way to it (8.0%)"]
    assert losses(job)[0] == (3, 51, 80, 0.08)
    assert losses(job)[1] == (0, 2, 0, 0.002)  # under LOSSY_SHARE: in `jobs ID` alone
    assert losses({"contributions_missed": {"1": 3}}) == [(1, 3, 0, None)]  # no segment yet


def test_status_names_ranks_that_share_a_hosts_link() -> None:
    """Several ranks behind one NIC, talking to the appliance each (numpy clients, a flat
    torch group): each sends its whole tensor through that link. One host's job alone has no
    link to spare, and is not named."""
    def job(endpoints: dict[str, str]) -> dict[str, object]:
        return {"job_id": 3, "name": "packed", "state": "active", "world_size": 4,
                "joined": [0, 1, 2, 3], "epoch": 1, "rounds": 12, "bytes_reduced": 0,
                "last_activity_s": 0.1, "lagging": {}, "endpoints": endpoints}
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "interfaces": [], "steering": [], "steering_notes": [], "rdma_devices": []}
    packed = job({"0": "198.18.0.101:4000", "1": "198.18.0.101:4001",
                  "2": "198.18.0.102:4000", "3": "198.18.0.101:4002"})
    named = [line for line in render_status(snapshot | {"jobs": [packed]}).splitlines()
             if " share " in line]
    assert named == ["     ! ranks 0, 1, 3 share 198.18.0.101: each sends its whole tensor "
                     "through that host's link (torch groups reduce on the host first unless "
                     "REDUCTION_HIERARCHY=flat or deterministic)"]
    assert shared_hosts(packed) == [("198.18.0.101", [0, 1, 3])]
    one_host = job({str(r): f"127.0.0.1:{4000 + r}" for r in range(4)})
    spread = job({str(r): f"198.18.0.{101 + r}:4000" for r in range(4)})
    assert shared_hosts(one_host) == shared_hosts(spread) == []
    assert " share " not in render_status(snapshot | {"jobs": [one_host, spread]})


def test_status_names_ranks_whose_hosts_hold_their_windows() -> None:
    """Workers that are not root on hosts with net.core.rmem_max at its default hold their
    windows to what their receive buffers take (plugin/hostchecks.py) and say so as they join:
    the operator sees which ranks, to what, and the fix."""
    job = {"job_id": 3, "name": "held", "state": "active", "world_size": 4,
           "joined": [0, 1, 2, 3], "epoch": 1, "rounds": 12, "bytes_reduced": 0,
           "last_activity_s": 0.1, "lagging": {}, "slots_per_core": 32,
           "windows_held": {"3": 21, "0": 21, "2": 9}}
    snapshot = {"version": "0.1.0", "uptime_s": 5.0, "config": "a.toml", "cores": [],
                "interfaces": [], "steering": [], "steering_notes": [], "rdma_devices": []}
    named = [line for line in render_status(snapshot | {"jobs": [job]}).splitlines()
             if " windows to " in line]
    assert named == [
        "     ! rank 2 holds its windows to 9 of 32 slots a core: its host caps UDP receive "
        "buffers (net.core.rmem_max, workers not root). There: sysctl -w net.core.rmem_max="
        "67108864 net.core.wmem_max=67108864",
        "     ! ranks 0, 3 hold their windows to 21 of 32 slots a core: their hosts cap UDP "
        "receive buffers (net.core.rmem_max, workers not root). There: sysctl -w net.core."
        "rmem_max=67108864 net.core.wmem_max=67108864"]
    assert held_windows(job) == [(9, [2]), (21, [0, 3])]
    assert " windows to " not in render_status(snapshot | {"jobs": [job | {"windows_held": {}}]})


def test_one_job_is_shown_in_an_operators_words() -> None:
    """`reductionctl jobs ID` printed its dictionaries raw ("last_activity_s:
    0.0331327340027201", the cores under "endpoints"); now a line per question."""
    job = {"job_id": 3, "name": "resnet", "state": "active", "world_size": 2, "joined": [0, 1],
           "deterministic": False, "segment_bytes": 8896, "epoch": 1,
           "multicast": {"group": "239.255.0.3", "port": 7100},
           "endpoints": [{"core": 0, "host": "198.18.0.1", "port": 7000, "slots": 64},
                         {"core": 1, "host": "198.18.0.1", "port": 7001, "slots": 64}]}
    live = {"epoch": 2, "rounds": 40, "bytes_reduced": 3 * 2**20, "last_activity_s": 0.25,
            "endpoints": {"0": "198.18.0.101:40000", "1": "198.18.0.102:40001"},
            "heard_s": {"1": 0.4, "0": 0.05}, "lagging": {"1": 2.5},
            "seen_elsewhere": {"1": "10.0.0.5:32768"}, "segments_reduced": 400,
            "contributions_missed": {"0": 1, "1": 20}, "results_lost": {"1": 30}}
    assert render_job(job, live).splitlines() == [
        "         job: 3 resnet (active, epoch 2)",
        "       ranks: 2 of 2 joined [0, 1]",
        "       cores: 198.18.0.1:7000 (64 slots), 198.18.0.1:7001 (64 slots)",
        "    segments: 8896 bytes, results multicast to 239.255.0.3:7100",
        "     reduced: 40 rounds, 3 MiB, last 0.2s ago",
        " joined from: 0: 198.18.0.101:40000, 1: 198.18.0.102:40001",
        "  last heard: 0: 0.1s ago, 1: 0.4s ago",
        "  waited for: 1: 2.5s",
        "        lost: rank 1: 20 contributions never came (5.0%), 30 results lost on the way "
        "to it (7.5%); rank 0: 1 contribution never came (0.2%), 0 results lost on the way to "
        "it (0.0%)",
        " ! elsewhere: 1: 10.0.0.5:32768",
    ]
    bare = render_job(job | {"multicast": None, "joined": []}, {}).splitlines()
    assert bare[1:] == ["       ranks: 0 of 2 joined []",
                        "       cores: 198.18.0.1:7000 (64 slots), 198.18.0.1:7001 (64 slots)",
                        "    segments: 8896 bytes, results by unicast",
                        "     reduced: 0 rounds, 0 B, last never",
                        " joined from: -", "  last heard: -", "  waited for: -",
                        "        lost: -"]


@pytest.mark.parametrize("taken", ["dataplane", "metrics"])
def test_a_port_in_use_fails_the_start_naming_its_key_and_address(taken: str,
                                                                   tmp_path: Path) -> None:
    """A core's data port in use ended reductiond with "core 0 failed: OSError: [Errno 98]
    Address already in use" (a bug report's words, naming no address); a metrics port in use
    with "cannot listen: ...", not saying which listener."""
    kind = socket.SOCK_DGRAM if taken == "dataplane" else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as holder, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as spare:
        holder.bind(("127.0.0.1", 0))
        spare.bind(("127.0.0.1", 0))  # a free port for the other listener, held till the start
        port, free = holder.getsockname()[1], spare.getsockname()[1]
        data_port, metrics_port = (port, free) if taken == "dataplane" else (free, port)
        config = tmp_path / "appliance.toml"
        config.write_text(
            f'[dataplane]\naddress = "127.0.0.1"\nbase_port = {data_port}\ncores = 1\n'
            f'slot_memory_mb = 16\n[multicast]\nenabled = false\n'
            f'[api]\nlisten = ""\nunix_socket = "{tmp_path / "api.sock"}"\n'
            f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n')
        spare.close()
        done = subprocess.run([sys.executable, "-m", "reduction_appliance.control.daemon",
                               "--config", str(config)], capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 2, done.stderr
    said = {"dataplane": f"core 0: cannot receive on 127.0.0.1:{port} (dataplane.address, "
                         "dataplane.base_port + the core's index): Address already in use: "
                         "another reductiond, or another service, has it",
            "metrics": f"cannot listen on metrics.listen = 127.0.0.1:{port}: Address already "
                       "in use (another reductiond, or another service, has it"}[taken]
    assert said in done.stderr
