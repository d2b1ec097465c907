"""The bench's probe: the machine's CPU split into user space and the kernel, idle and steal."""

from __future__ import annotations

import os
import time

from reduction_appliance.deploy.testnet.probe import Probe, machine_cpu


def _spin(seconds: float) -> None:
    # time.monotonic is read in user space (vDSO); process_time would be a system call.
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _syscalls(seconds: float) -> None:
    # Work the kernel does, not the interpreter: zeroing 1 MiB takes tens of microseconds of
    # kernel time per call against about one of Python's. (A loop of os.stat("/") spent most
    # of its time in the interpreter: 0.03 s of 0.3 in the kernel on a slow day, under the
    # assertion's 0.05.)
    buf = bytearray(1 << 20)
    with open("/dev/zero", "rb", buffering=0) as zero:  # unbuffered: one read(2) per call
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            zero.readinto(buf)


def test_a_busy_loop_shows_as_user_time_and_syscalls_as_kernel_time() -> None:
    probe = Probe(machine=True)
    probe.before()
    _spin(0.3)
    probe.after(0.3)
    report = probe.report()["machine_cpu_s"]
    assert isinstance(report, dict)
    # Most of the spin (other processes can only add; 10 ms ticks; the spin may be preempted).
    assert report["user"] >= 0.15, report
    user, kernel, _, _ = machine_cpu()
    _syscalls(0.3)
    user2, kernel2, _, _ = machine_cpu()
    assert kernel2 - kernel >= 0.05 and user2 >= user, (user, kernel, user2, kernel2)


def test_the_four_parts_cover_every_cpu_s_time() -> None:
    # Busy, idle or stolen: each CPU's every tick is one of them, so over an interval the four
    # add up to the interval on every CPU (to within a few 10 ms ticks per CPU).
    cpus = os.cpu_count() or 1
    probe = Probe(machine=True)
    probe.before()
    _spin(0.3)
    probe.after(0.3)
    report = probe.report()["machine_cpu_s"]
    assert isinstance(report, dict) and set(report) == {"user", "kernel", "idle", "steal"}
    assert all(v >= 0 for v in report.values()), report
    assert abs(sum(report.values()) - probe.probed_s * cpus) <= 0.05 * cpus, (report, cpus)


def test_without_machine_the_report_has_no_split() -> None:
    probe = Probe()
    probe.before()
    probe.after(0.0)
    assert "machine_cpu_s" not in probe.report()
