"""The emulated rack itself: connectivity, jumbo MTU, multicast flooding, shaping, teardown."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from pyroute2 import netns

from reduction_appliance.deploy.testnet import (
    Lab,
    LabError,
    Link,
    Topology,
    clean,
    leftovers,
    unique_prefix,
)
from reduction_appliance.deploy.testnet.harness import remove_orphaned_loopback_namespaces
from reduction_appliance.deploy.testnet.shaping import egress_ruleset
from tests.signals import as_from_a_terminal
from tests.waiting import wait_until

MakeLab = Callable[[Topology], Lab]
PY = sys.executable

# Receivers write `ready` once bound, so senders never race them and tests never sleep.
UDP_RECV = """
import json, socket, sys
port, ready, count, idle = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: no drops at our socket
if len(sys.argv) > 6:  # group, local address: join a multicast group on the data interface
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                 socket.inet_aton(sys.argv[5]) + socket.inet_aton(sys.argv[6]))
s.bind(("", port))
s.settimeout(idle)
open(ready, "w").close()
sizes = []
try:
    while len(sizes) < count:
        sizes.append(len(s.recv(65535)))
except TimeoutError:
    pass
print(json.dumps(sizes))
"""

UDP_SEND = """
import socket, sys
dst, port, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO: DF set
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
for _ in range(count):
    s.sendto(b"x" * size, (dst, port))
"""

TCP_SINK = """
import json, socket, sys, time
port, ready = int(sys.argv[1]), sys.argv[2]
srv = socket.create_server(("", port))
open(ready, "w").close()
conn, _ = srv.accept()
total, first = 0, None
while chunk := conn.recv(1 << 20):
    first = first or time.monotonic()
    total += len(chunk)
print(json.dumps({"bytes": total, "seconds": time.monotonic() - first}))
"""

TCP_SOURCE = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
    s.sendall(b"x" * int(sys.argv[3]))
"""


# Numbered datagrams: the receiver reports sequence numbers in arrival order. It stops once it
# has every number and nothing more came for `idle` seconds (late duplicates), or after `idle`
# seconds of silence with numbers still missing.
SEQ_RECV = """
import json, socket, struct, sys
port, ready, count, idle = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: no drops at our socket
if len(sys.argv) > 6:
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                 socket.inet_aton(sys.argv[5]) + socket.inet_aton(sys.argv[6]))
s.bind(("", port))
open(ready, "w").close()
seqs, seen = [], set()
s.settimeout(5.0)  # until the first datagram
try:
    while True:
        seq = struct.unpack_from("!I", s.recv(65535))[0]
        seqs.append(seq)
        seen.add(seq)
        s.settimeout(idle if len(seen) == count else 1.0)
except TimeoutError:
    pass
print(json.dumps(seqs))
"""

SEQ_SEND = """
import socket, struct, sys
dst, port, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO: DF set
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
pad = b"x" * (size - 4)
for seq in range(count):
    s.sendto(struct.pack("!I", seq) + pad, (dst, port))
"""


def _wait_ready(proc: subprocess.Popen[str], ready: Path, what: str) -> None:
    """Wait for the ready file, failing at once (with its stderr) if the process died first."""
    wait_until(lambda: ready.exists() or proc.poll() is not None, 5.0, what=what)
    if not ready.exists():
        _, err = proc.communicate(timeout=5)
        pytest.fail(f"{what} exited {proc.returncode}: {err}")


def _start_udp_receiver(
    lab: Lab, host: str, tmp_path: Path, port: int, count: int, *extra: str
) -> subprocess.Popen[str]:
    ready = tmp_path / f"ready-{host}-{port}"
    proc = lab.popen(
        host,
        [PY, "-c", UDP_RECV, str(port), str(ready), str(count), "1.0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_ready(proc, ready, f"UDP receiver on {host}:{port}")
    return proc


def _sizes(proc: subprocess.Popen[str]) -> list[int]:
    out, _ = proc.communicate(timeout=8)
    assert proc.returncode == 0
    sizes: list[int] = json.loads(out)
    return sizes


def test_ping_between_hosts(lab: MakeLab) -> None:
    if shutil.which("ping") is None:
        pytest.skip("needs ping (Debian: apt-get install iputils-ping)")
    rack = lab(Topology.rack(workers=3, mtu=9000))
    for src, dst in [("w0", "a0"), ("w1", "a0"), ("w2", "a0"), ("a0", "w2"), ("w0", "w2")]:
        rack.run(src, ["ping", "-c1", "-W1", rack.address_of(dst)])


def test_jumbo_datagram_with_df_crosses_the_switch(lab: MakeLab, tmp_path: Path) -> None:
    rack = lab(Topology.rack(workers=3, mtu=9000))
    receiver = _start_udp_receiver(rack, "a0", tmp_path, 5000, 1)
    rack.run("w0", [PY, "-c", UDP_SEND, rack.address_of("a0"), "5000", "8000", "1"])
    assert _sizes(receiver) == [8000]
    # DF really is set: one byte over the 9000-byte MTU (minus IP + UDP headers) is refused.
    too_big = rack.run(
        "w0", [PY, "-c", UDP_SEND, rack.address_of("a0"), "5000", "8973", "1"], check=False
    )
    assert too_big.returncode != 0
    assert "Message too long" in too_big.stderr


def test_the_switch_forwards_frames_without_the_ip_firewall_hooks(lab: MakeLab) -> None:
    entries = ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"]
    if not os.path.exists(f"/proc/sys/net/bridge/{entries[0]}"):
        pytest.skip("br_netfilter is not loaded on this machine: bridges never call netfilter's "
                    "IP hooks, so there is nothing to turn off")
    rack = lab(Topology.rack(workers=2, mtu=9000))
    switch = rack.topology.switch_netns
    read = subprocess.run(["ip", "netns", "exec", switch, "cat",
                           *(f"/proc/sys/net/bridge/{e}" for e in entries)],
                          capture_output=True, text=True, check=True)
    assert read.stdout.split() == ["0", "0", "0"], read
    # ... in the switch's namespace only: a fresh namespace still has them on (the default).
    fresh = subprocess.run(["ip", "netns", "exec", rack.topology.netns_name("w0"), "cat",
                            f"/proc/sys/net/bridge/{entries[0]}"],
                           capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "1", fresh


def test_multicast_from_appliance_reaches_every_worker(lab: MakeLab, tmp_path: Path) -> None:
    rack = lab(Topology.rack(workers=3))
    group = "239.255.7.9"
    receivers = {
        w.name: _start_udp_receiver(rack, w.name, tmp_path, 6000, 1, group, rack.address_of(w.name))
        for w in rack.topology.workers
    }
    rack.run("a0", [PY, "-c", UDP_SEND, group, "6000", "4000", "1"])
    assert {name: _sizes(proc) for name, proc in receivers.items()} == {
        "w0": [4000],
        "w1": [4000],
        "w2": [4000],
    }


@pytest.mark.parametrize(("src", "dst"), [("w0", "a0"), ("a0", "w0")])
def test_tbf_limits_both_directions_of_a_worker_link(
    lab: MakeLab, tmp_path: Path, src: str, dst: str
) -> None:
    rack = lab(Topology.rack(workers=1, rate="100mbit"))
    ready = tmp_path / "ready-sink"
    sink = rack.popen(
        dst,
        [PY, "-c", TCP_SINK, "7000", str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_ready(sink, ready, "TCP sink")
    size = 3_000_000
    rack.run(src, [PY, "-c", TCP_SOURCE, rack.address_of(dst), "7000", str(size)], timeout_s=8)
    out, _ = sink.communicate(timeout=8)
    result = json.loads(out)
    assert result["bytes"] == size
    mbit = size * 8 / result["seconds"] / 1e6
    # The bucket's initial burst lets the first ~125 kB through at once: expect ~100-105 mbit.
    assert 40 < mbit < 130, f"{mbit:.1f} mbit/s through a 100mbit link"


def test_loss_drops_about_the_asked_fraction(lab: MakeLab, tmp_path: Path) -> None:
    if shutil.which("nft") is None:
        pytest.skip("loss_pct needs nft (Debian: apt-get install nftables)")
    rack = lab(Topology.rack(workers=1, loss_pct=20.0))
    sent = 500
    receiver = _start_udp_receiver(rack, "a0", tmp_path, 5001, sent)
    rack.run("w0", [PY, "-c", UDP_SEND, rack.address_of("a0"), "5001", "200", str(sent)])
    got = len(_sizes(receiver))
    # Binomial(500, 0.2) drops: mean 100, sd ~9; the bounds are > 5 sd away.
    assert 50 <= sent - got <= 150, f"{sent - got} of {sent} lost at loss_pct=20"


GSO_SEQ_SEND = """
import socket, struct, sys
dst, port, size, sends = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
pad = b"x" * (size - 4)
for send in range(sends):  # 7 numbered datagrams per GSO send (UDP_SEGMENT = 103)
    batch = b"".join(struct.pack("!I", send * 7 + i) + pad for i in range(7))
    s.sendmsg([batch], [(socket.SOL_UDP, 103, struct.pack("=H", size))], 0, (dst, port))
"""


def test_loss_is_per_datagram_even_for_gso_sends(lab: MakeLab, tmp_path: Path) -> None:
    """A GSO send leaves the host as separate frames (as from a NIC with segmentation
    offload), so the switch drops datagrams, not whole super-packets."""
    if shutil.which("nft") is None:
        pytest.skip("loss_pct needs nft (Debian: apt-get install nftables)")
    rack = lab(Topology.rack(workers=1, loss_pct=20.0))
    sends = 300
    ready = tmp_path / "ready"
    receiver = rack.popen("w0", [PY, "-c", SEQ_RECV, "5003", str(ready), str(7 * sends), "1.0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_ready(receiver, ready, "sequence receiver on w0")
    rack.run("a0", [PY, "-c", GSO_SEQ_SEND, rack.address_of("w0"), "5003", "200", str(sends)])
    out, err = receiver.communicate(timeout=30)
    assert receiver.returncode == 0, err
    arrived = Counter(seq // 7 for seq in set(json.loads(out)))
    partial = sum(1 for send in range(sends) if 0 < arrived[send] < 7)
    # Per datagram: a send arrives in part with probability 1 - 0.8^7 - 0.2^7 = 0.79 (mean 237
    # of 300, sd ~7). Whole super-packets dropped or passed: never in part.
    assert partial > 150, f"{partial} of {sends} GSO sends arrived in part"


GRO_RECV = """
import json, socket, sys
port, ready, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: no drops at our socket
s.setsockopt(socket.SOL_UDP, 104, 1)  # UDP_GRO
s.bind(("", port))
open(ready, "w").close()
buf, calls, total = bytearray(65536), 0, 0
s.settimeout(5.0)
try:
    while total < count:
        nbytes, anc, _, _ = s.recvmsg_into([buf], socket.CMSG_SPACE(4))
        size = int.from_bytes(anc[0][2], sys.byteorder) if anc else nbytes
        calls += 1
        total += -(-nbytes // size)
except TimeoutError:
    pass
print(json.dumps({"calls": calls, "datagrams": total}))
"""


def test_received_datagrams_are_coalesced_as_by_a_nics_gro(lab: MakeLab, tmp_path: Path) -> None:
    """Frames on the wire, bursts at a socket that asks for UDP_GRO: what a NIC with receive
    offload gives, and what the appliance's and workers' receive paths are built for."""
    rack = lab(Topology.rack(workers=1))
    sends = 200
    ready = tmp_path / "ready"
    receiver = rack.popen("w0", [PY, "-c", GRO_RECV, "5004", str(ready), str(7 * sends)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_ready(receiver, ready, "GRO receiver on w0")
    rack.run("a0", [PY, "-c", GSO_SEQ_SEND, rack.address_of("w0"), "5004", "1400", str(sends)])
    out, err = receiver.communicate(timeout=30)
    assert receiver.returncode == 0, err
    got = json.loads(out)
    assert got["datagrams"] == 7 * sends, got
    assert got["calls"] < got["datagrams"] / 2, f"hardly coalesced: {got}"

def _require_nft() -> None:
    if shutil.which("nft") is None:
        pytest.skip("loss/duplicate/reorder need nft (Debian: apt-get install nftables)")


def _inversions(seqs: list[int]) -> int:
    """Adjacent pairs arriving in descending order."""
    return sum(1 for a, b in itertools.pairwise(seqs) if b < a)


def _numbered_datagrams(
    rack: Lab, tmp_path: Path, direction: str, count: int, size: int = 8000
) -> dict[str, list[int]]:
    """Send ``count`` numbered jumbo datagrams as fast as Python goes, across the worker links:
    "up" from w0 to a0 (unicast), "down" from a0 to a group every worker joined. Returns the
    sequence numbers each receiver got, in arrival order."""
    port = 5100
    if direction == "up":
        src, dst = "w0", rack.address_of("a0")
        receivers = {"a0": _start_seq_receiver(rack, "a0", tmp_path, port, count)}
    else:
        src, dst = "a0", "239.255.7.10"
        receivers = {
            w.name: _start_seq_receiver(
                rack, w.name, tmp_path, port, count, dst, rack.address_of(w.name)
            )
            for w in rack.topology.workers
        }
    rack.run(src, [PY, "-c", SEQ_SEND, dst, str(port), str(size), str(count)])
    got = {}
    for name, proc in receivers.items():
        out, err = proc.communicate(timeout=8)
        assert proc.returncode == 0, err
        got[name] = json.loads(out)
    return got


def _start_seq_receiver(
    lab: Lab, host: str, tmp_path: Path, port: int, count: int, *extra: str
) -> subprocess.Popen[str]:
    ready = tmp_path / f"ready-seq-{host}-{port}"
    proc = lab.popen(
        host,
        [PY, "-c", SEQ_RECV, str(port), str(ready), str(count), "0.2", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_ready(proc, ready, f"sequence receiver on {host}:{port}")
    return proc


@pytest.mark.parametrize("direction", ["up", "down"])
def test_duplication_on_worker_links(lab: MakeLab, tmp_path: Path, direction: str) -> None:
    _require_nft()
    rack = lab(Topology.rack(workers=2, duplicate_pct=5.0, mtu=9000))
    sent = 2000
    for host, seqs in _numbered_datagrams(rack, tmp_path, direction, sent).items():
        assert sorted(set(seqs)) == list(range(sent)), f"{host} lost datagrams"
        dups = len(seqs) - sent
        # Binomial(2000, 0.05): mean 100, sd ~9.7; the bounds are > 5 sd away.
        assert 50 <= dups <= 150, f"{host}: {dups} duplicates of {sent} at duplicate_pct=5"


@pytest.mark.parametrize("direction", ["up", "down"])
def test_reordering_on_worker_links(lab: MakeLab, tmp_path: Path, direction: str) -> None:
    _require_nft()
    rack = lab(Topology.rack(workers=2, reorder_pct=10.0, mtu=9000))
    sent = 2000
    for host, seqs in _numbered_datagrams(rack, tmp_path, direction, sent).items():
        assert sorted(seqs) == list(range(sent)), f"{host}: lost or duplicated datagrams"
        inversions = _inversions(seqs)
        # About 200 packets are held back; each inversion needs at least one of them.
        assert 1 <= inversions <= 300, f"{host}: {inversions} inversions at reorder_pct=10"


def test_unimpaired_links_keep_order(lab: MakeLab, tmp_path: Path) -> None:
    rack = lab(Topology.rack(workers=2, mtu=9000))
    for host, seqs in _numbered_datagrams(rack, tmp_path, "down", 2000).items():
        assert seqs == list(range(2000)), host


@pytest.mark.slow
def test_loss_duplication_and_reordering_together(lab: MakeLab, tmp_path: Path) -> None:
    _require_nft()
    rack = lab(Topology.rack(workers=1, loss_pct=1.0, duplicate_pct=5.0, reorder_pct=10.0))
    sent = 2000
    for direction in ("up", "down"):
        seqs = next(iter(_numbered_datagrams(rack, tmp_path, direction, sent).values()))
        lost = sent - len(set(seqs))
        assert 1 <= lost <= 60, f"{direction}: {lost} lost at loss_pct=1"  # mean 20, sd ~4.4
        assert 40 <= len(seqs) - len(set(seqs)) <= 160, direction
        assert _inversions(seqs) >= 1, direction


def test_rate_holds_with_reordering_and_duplication(lab: MakeLab, tmp_path: Path) -> None:
    _require_nft()
    rack = lab(Topology.rack(workers=1, rate="100mbit", duplicate_pct=5.0, reorder_pct=10.0))
    ready = tmp_path / "ready-sink"
    sink = rack.popen(
        "a0",
        [PY, "-c", TCP_SINK, "7000", str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_ready(sink, ready, "TCP sink")
    size = 3_000_000
    rack.run("w0", [PY, "-c", TCP_SOURCE, rack.address_of("a0"), "7000", str(size)], timeout_s=8)
    out, _ = sink.communicate(timeout=8)
    result = json.loads(out)
    assert result["bytes"] == size
    mbit = size * 8 / result["seconds"] / 1e6
    # Duplicates take link capacity and reordering may cost TCP some speed; never above rate.
    assert 20 < mbit < 130, f"{mbit:.1f} mbit/s through a 100mbit link"


def test_netem_delay_when_the_kernel_has_it(lab: MakeLab) -> None:
    if shutil.which("ping") is None:
        pytest.skip("needs ping (Debian: apt-get install iputils-ping)")
    try:
        rack = lab(Topology.rack(workers=1, delay_ms=20.0))
    except LabError as exc:
        if "CONFIG_NET_SCH_NETEM" in str(exc):
            pytest.skip(str(exc))
        raise
    out = rack.run("w0", ["ping", "-c1", "-W2", rack.address_of("a0")]).stdout
    rtt_ms = float(out.split("time=")[1].split()[0])
    assert rtt_ms >= 40.0  # 20 ms on the worker's egress and again on its switch port


def test_teardown_after_an_exception_kills_children_and_leaves_nothing(tmp_path: Path) -> None:
    topology = Topology.rack(workers=2)
    with pytest.raises(RuntimeError, match="boom"), Lab(topology) as rack:
        child = rack.popen("w1", ["sleep", "60"])
        raise RuntimeError("boom")
    assert child.poll() is not None
    assert leftovers(topology.name_prefix) == []


def test_clean_removes_leftovers_by_prefix() -> None:
    prefix = unique_prefix()
    names = [f"{prefix}-x", f"{prefix}-y"]
    for name in names:
        netns.create(name)
    assert sorted(leftovers(prefix)) == names
    assert sorted(clean(prefix)) == names
    assert leftovers(prefix) == []
    with pytest.raises(ValueError):
        clean("")


def test_names_are_unique_and_fit_interface_names() -> None:
    a, b = Topology.rack(workers=154), Topology.rack(workers=154)
    assert a.name_prefix != b.name_prefix
    assert max(len(a.port_ifname(h.name)) for h in a.hosts) <= 15
    assert a.host("a0").address == "198.18.0.1"
    assert a.host("w0").address == "198.18.0.101"


def test_duplicate_and_reorder_need_no_netem() -> None:
    plain = Link(rate="1gbit")
    assert not plain.nft_impaired
    assert egress_ruleset({"dev0": plain}) == ""
    impaired = Link(duplicate_pct=2.5, reorder_pct=10.0)  # no delay needed any more
    assert impaired.nft_impaired and not impaired.uses_netem
    script = egress_ruleset({"dev0": impaired})
    assert 'hook egress device "dev0"' in script
    assert (
        'numgen random mod 1000000 < 25000 meta mark set meta mark | 0x40000000 dup to "dev0"'
        in script
    )
    assert "< 100000 meta priority set 1:20" in script
    # With a delay, netem does all three (and nftables none).
    assert not Link(delay_ms=1.0, duplicate_pct=1.0, reorder_pct=1.0).nft_impaired


def test_a_loopback_namespace_whose_maker_died_is_removed_and_a_living_ones_kept() -> None:
    """A loopback run killed outright leaves its namespace (ra-lo-<pid>); the next run removes
    it, but never one whose maker still runs."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan, living = f"ra-lo-{dead.pid}", f"ra-lo-{os.getppid()}"
    for name in (orphan, living):
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        removed = remove_orphaned_loopback_namespaces()
        assert orphan in removed and living not in removed
        assert orphan not in netns.listnetns() and living in netns.listnetns()
    finally:
        for name in (orphan, living):
            with contextlib.suppress(OSError):
                netns.remove(name)


TERMINATED_RUN = """
import sys
from reduction_appliance.deploy.testnet.harness import LabNetwork, start_appliance
with LabNetwork.rack(1) as net, start_appliance(net, cores=1) as appliance:
    print(net.lab.topology.name_prefix, appliance.process.pid, flush=True)
    sys.stdin.read()  # until the test stops this process
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_run_stopped_by_sigterm_or_sighup_tears_its_rack_and_daemon_down(signum: int) -> None:
    """`reductionctl bench` stopped with SIGTERM (`timeout`, a cancelled CI job) or SIGHUP (a
    closed terminal) left its rack's namespaces, and a reductiond running inside them."""
    with as_from_a_terminal():  # the run's dispositions: not those this suite inherited
        run = subprocess.Popen([PY, "-c", TERMINATED_RUN], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout is not None
    line = run.stdout.readline().split()
    assert len(line) == 2, run.communicate(timeout=60)[1]
    prefix, daemon = line[0], int(line[1])
    try:
        assert leftovers(prefix) != []
        run.send_signal(signum)
        _, err = run.communicate(timeout=60)
        assert run.returncode != 0 and "Terminated" in err
        assert leftovers(prefix) == []
        with pytest.raises(ProcessLookupError):
            os.kill(daemon, 0)  # reaped by the run: gone, not a zombie
    finally:  # what a failing run left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(daemon, signal.SIGKILL)
        clean(prefix)
