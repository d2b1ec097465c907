"""Build a :class:`~deploy.testnet.topology.Topology` on network namespaces, and tear it down.

Layout: one namespace per host, plus one for the top-of-rack switch holding a Linux bridge.
Each host has a veth pair: ``<prefix><host>`` in the host namespace, ``<prefix><host>s`` as a
bridge port. Building uses pyroute2; commands run in a host with ``ip netns exec``.

    with Lab(Topology.rack(workers=3)) as lab:
        lab.run("w0", ["ping", "-c1", lab.address_of("a0")])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from pyroute2 import IPRoute, netns
from pyroute2.ethtool.ethtool import Ethtool

from reduction_appliance.deploy.testnet.shaping import (
    ShapingUnsupportedError,
    apply_qdiscs,
    egress_ruleset,
    loss_ruleset,
)
from reduction_appliance.deploy.testnet.topology import Topology
from reduction_appliance.deploy.testnet.unwind import unwinding_on_termination

_TERM_GRACE_S = 2.0
# IPv6 off everywhere: no DAD, router solicitations or MLD reports to disturb packet counts.
_QUIET_SYSCTLS = {
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}
# A switch forwards frames without a host's firewall. Where br_netfilter is loaded (Docker and
# Kubernetes hosts load it; this kernel has it built in), every namespace's bridges pass each
# frame through the IPv4 (and IPv6, ARP) netfilter hooks by default, a routing lookup included:
# 2% of the machine's CPU at n = 8 on the rack, taken per frame, so from a UDP sender's every
# 8.9 KB datagram but only once per 64 KB TCP segment (the switch's ports segment TCP after
# forwarding). Off in the switch's namespace; the lab's own impairments are nftables rules of
# the bridge family (shaping.py), which the bridge runs either way. Where the module is absent
# these entries do not exist, and there is nothing to turn off.
_SWITCH_IF_PRESENT = {
    "net.bridge.bridge-nf-call-iptables": "0",
    "net.bridge.bridge-nf-call-ip6tables": "0",
    "net.bridge.bridge-nf-call-arptables": "0",
}
# rp_filter off (set before the interface exists, so it inherits "default"): the data plane may
# legitimately see traffic whose reverse path points elsewhere.
_HOST_SYSCTLS = {
    **_QUIET_SYSCTLS,
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
}


#: A NIC's offloads, as the lab's veth pairs imitate them: the host's end segments UDP GSO sends
#: before they leave (each datagram is its own frame on the wire) and coalesces what it
#: receives (GRO through veth's NAPI path); the switch's end offers no TCP segmentation, which
#: is what makes frames it forwards eligible for the host's GRO (veth_skb_is_eligible_for_gro).
_HOST_END = {"tx-udp-segmentation": False, "rx-gro": True}
_SWITCH_END = {"tx-tcp-segmentation": False, "tx-tcp6-segmentation": False,
               "tx-tcp-ecn-segmentation": False, "tx-tcp-mangleid-segmentation": False}


def _like_a_nic(ns_name: str, ifname: str, wanted: dict[str, bool]) -> None:
    """Set `ifname`'s offload features in `ns_name` as `wanted`. Without it veth carries a GSO
    super-packet (up to 64 datagrams) through the switch whole, and the switch's loss rules
    drop or pass all of its datagrams together (20% loss of super-packets of 7 results is not
    20% datagram loss), and a receiver never sees GRO's bursts."""
    netns.pushns(ns_name)  # the ioctl acts on the namespace of the socket Ethtool opens
    try:
        ethtool = Ethtool()
        try:
            features = ethtool.get_features(ifname)
            for name, enable in wanted.items():
                features.features[name].enable = enable
            ethtool.set_features(ifname, features)
        finally:
            ethtool.close()
    except (OSError, KeyError) as exc:
        raise LabError(f"{ns_name}: cannot set {ifname}'s offloads as a NIC's ({wanted}): "
                       f"{exc}") from exc
    finally:
        netns.popns()


class LabError(RuntimeError):
    """Building or driving the lab failed; the message names the host or missing capability."""


class LabCommandError(subprocess.CalledProcessError):
    """A command run with ``Lab.run(check=True)`` failed; str() includes its stderr."""

    def __str__(self) -> str:
        err = self.stderr if isinstance(self.stderr, str) else (self.stderr or b"").decode()
        return f"{super().__str__()}\nstderr: {err.strip()[-2000:]}"


def _ipr(name: str) -> Any:
    # flags=0: never create a namespace implicitly (pyroute2's default is O_CREAT).
    return IPRoute(netns=name, flags=0)


def _write_sysctls(ns_name: str, values: Mapping[str, str],
                   if_present: Mapping[str, str] | None = None) -> None:
    """Write /proc/sys entries inside a namespace without forking; `if_present`'s only where
    the kernel has them (a module's entries).

    setns(2) moves only the calling thread, and /proc/sys/net resolves against the writer's
    namespace, so a throwaway thread can do it while the caller stays where it is.
    """
    failure: list[BaseException] = []

    def work() -> None:
        try:
            netns.setns(ns_name, flags=0)
            for key, value in [*values.items(), *(if_present or {}).items()]:
                path = "/proc/sys/" + key.replace(".", "/")
                if key not in values and not os.path.exists(path):
                    continue
                with open(path, "w") as fh:
                    fh.write(value)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=work, name=f"sysctl-{ns_name}")
    thread.start()
    thread.join()
    if failure:
        raise LabError(f"sysctl in {ns_name}: {failure[0]}") from failure[0]


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kill whatever still runs in the namespaces (it would keep them alive), then unmount them."""
    existing = set(netns.listnetns())
    targets = [n for n in names if n in existing]
    if not targets:
        return []
    pids_by_ns = netns.ns_pids()
    errors: list[str] = []
    for name in targets:
        _kill_pids(pids_by_ns.get(name, []))
        try:
            netns.remove(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    if errors:
        raise LabError("could not remove namespaces: " + "; ".join(errors))
    return targets


def _root_links(prefix: str) -> list[str]:
    with IPRoute() as ipr:
        names = [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]
    return [n for n in names if isinstance(n, str) and n.startswith(prefix)]


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace interfaces whose name starts with ``prefix``."""
    if not prefix:
        raise ValueError("empty prefix would match everything")
    return [n for n in netns.listnetns() if n.startswith(prefix)] + _root_links(prefix)


def clean(prefix: str) -> list[str]:
    """Remove every namespace and root-namespace interface named ``prefix...``.

    Builds never create interfaces in the root namespace, but a crash of some other tool using
    the prefix might; removing namespaces destroys the veths inside them.
    """
    if not prefix:
        raise ValueError("empty prefix would match everything")
    removed = remove_namespaces([n for n in netns.listnetns() if n.startswith(prefix)])
    links = _root_links(prefix)
    if links:
        with IPRoute() as ipr:
            for name in links:
                with contextlib.suppress(Exception):  # a veth peer may have gone with its twin
                    ipr.link("del", ifname=name)
                    removed.append(name)
    return removed


def teardown(topology: Topology) -> list[str]:
    """Remove exactly the namespaces of ``topology`` (and so its interfaces): what a Lab's
    exit does, and what ``reductionctl lab down`` does for a lab left up with detach()."""
    return remove_namespaces(
        [topology.switch_netns, *(topology.netns_name(h.name) for h in topology.hosts)]
    )


class Lab:
    """The emulated rack, alive inside ``with Lab(topology) as lab:``.

    Teardown runs on any exit, including KeyboardInterrupt during the build, and SIGTERM or
    SIGHUP (`deploy.testnet.unwind`): it kills the processes started through the lab, then
    removes every namespace (and so every interface).
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._procs: list[subprocess.Popen[Any]] = []
        self._entered = False
        self._closed = False
        self._unwinding = contextlib.ExitStack()

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        if self._entered:
            raise LabError("a Lab can be entered once")
        self._entered = True
        # Torn down on SIGTERM and SIGHUP too (restored by close(), after the teardown).
        self._unwinding.enter_context(unwinding_on_termination())
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent teardown; raises LabError only after trying every step."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_procs()
            teardown(self.topology)
        finally:
            self._unwinding.close()

    def detach(self) -> None:
        """Leave the rack up after the with block (``reductionctl lab up``): teardown is skipped
        and processes started through the lab are no longer tracked; :func:`teardown` removes
        the rack later."""
        self._require_running()
        self._procs.clear()
        self._closed = True
        self._unwinding.close()

    # -- queries ---------------------------------------------------------------------------

    def netns_of(self, host_name: str) -> str:
        return self.topology.netns_name(self.topology.host(host_name).name)

    def address_of(self, host_name: str) -> str:
        return self.topology.host(host_name).address

    def interface_of(self, host_name: str) -> str:
        """The host's data interface (inside its namespace)."""
        return self.topology.host_ifname(self.topology.host(host_name).name)

    # -- running commands ------------------------------------------------------------------

    def popen(self, host_name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace; popen kwargs (env, stdout, ...) pass on.

        The child gets its own session by default so teardown can kill its whole process group
        and a terminal Ctrl-C reaches only the test runner, which then tears down in order.
        The lab kills children still running at teardown.
        """
        self._require_running()
        kwargs.setdefault("start_new_session", True)
        cmd = ["ip", "netns", "exec", self.netns_of(host_name), *argv]
        proc: subprocess.Popen[Any] = subprocess.Popen(cmd, **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self,
        host_name: str,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in the host's namespace to completion (text, captured output default)."""
        self._require_running()
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        cmd = ["ip", "netns", "exec", self.netns_of(host_name), *argv]
        done = subprocess.run(cmd, timeout=timeout_s, check=False, **kwargs)
        if check and done.returncode != 0:
            raise LabCommandError(done.returncode, list(argv), done.stdout, done.stderr)
        return done

    # -- internals -------------------------------------------------------------------------

    def _require_running(self) -> None:
        if not self._entered or self._closed:
            raise LabError("the lab is not running (use it inside its with block)")

    def _stop_procs(self) -> None:
        live = [p for p in self._procs if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in live:
            try:
                proc.wait(timeout=_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
        self._procs.clear()

    def _create_netns(self, name: str, sysctls: Mapping[str, str],
                      if_present: Mapping[str, str] | None = None) -> None:
        try:
            netns.create(name)
        except Exception as exc:
            raise LabError(f"cannot create network namespace {name}: {exc}") from exc
        _write_sysctls(name, sysctls, if_present)

    def _build(self) -> None:
        topo = self.topology
        max_mtu = max(topo.worker_link.mtu, topo.appliance_link.mtu)
        self._create_netns(topo.switch_netns, _QUIET_SYSCTLS, _SWITCH_IF_PRESENT)
        with _ipr(topo.switch_netns) as sw:
            # Snooping off: the bridge then floods IP multicast to every port, so no IGMP
            # querier is needed for group members to receive.
            sw.link(
                "add",
                ifname=topo.bridge_ifname,
                kind="bridge",
                br_mcast_snooping=0,
                br_stp_state=0,
                br_forward_delay=0,
            )
            bridge = sw.link_lookup(ifname=topo.bridge_ifname)[0]
            sw.link("set", index=bridge, state="up")
            lo = sw.link_lookup(ifname="lo")[0]
            sw.link("set", index=lo, state="up")
            for host in topo.hosts:
                self._build_host(sw, bridge, host.name)
            # The bridge takes the smallest port MTU; pin it to the largest so no port is capped.
            sw.link("set", index=bridge, mtu=max_mtu)
        self._install_nftables()

    def _build_host(self, sw: Any, bridge: int, name: str) -> None:
        topo = self.topology
        host = topo.host(name)
        link = topo.link_of(name)
        ns_name = topo.netns_name(name)
        host_if, port_if = topo.host_ifname(name), topo.port_ifname(name)
        self._create_netns(ns_name, _HOST_SYSCTLS)
        # Created inside the switch namespace with the peer placed straight into the host, so
        # nothing ever appears in the root namespace (where parallel runs could collide).
        sw.link("add", ifname=port_if, kind="veth", peer={"ifname": host_if, "net_ns_fd": ns_name})
        port = sw.link_lookup(ifname=port_if)[0]
        sw.link("set", index=port, mtu=link.mtu, master=bridge)
        try:
            apply_qdiscs(sw, port, link)
        except ShapingUnsupportedError as exc:
            raise LabError(f"{name}: {exc}") from exc
        _like_a_nic(topo.switch_netns, port_if, _SWITCH_END)
        sw.link("set", index=port, state="up")
        with _ipr(ns_name) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            index = ipr.link_lookup(ifname=host_if)[0]
            ipr.link("set", index=index, mtu=link.mtu)
            try:
                apply_qdiscs(ipr, index, link)
            except ShapingUnsupportedError as exc:
                raise LabError(f"{name}: {exc}") from exc
            ipr.addr("add", index=index, address=host.address, prefixlen=topo.prefixlen)
            _like_a_nic(ns_name, host_if, _HOST_END)
            ipr.link("set", index=index, state="up")
            # Multicast sends without IP_MULTICAST_IF follow the routing table; point the group
            # range at the data interface so senders need no per-socket setup.
            ipr.route("add", dst=topo.multicast_range, oif=index)

    def _install_nftables(self) -> None:
        """Loss (switch bridge), duplication and reorder marking (egress of both veth ends)."""
        topo = self.topology
        losses = {
            topo.port_ifname(h.name): topo.link_of(h.name).loss_pct
            for h in topo.hosts
            if topo.link_of(h.name).loss_pct > 0
        }
        switch_script = (loss_ruleset(losses) if losses else "") + egress_ruleset(
            {topo.port_ifname(h.name): topo.link_of(h.name) for h in topo.hosts}
        )
        if switch_script:
            self._nft(topo.switch_netns, switch_script)
        for host in topo.hosts:
            script = egress_ruleset({topo.host_ifname(host.name): topo.link_of(host.name)})
            if script:
                self._nft(topo.netns_name(host.name), script)

    def _nft(self, ns_name: str, script: str) -> None:
        # nftables through the nft(8) tool: pyroute2's nftables API has no rule builder for
        # numgen/dup expressions, and a short script is easier to read than raw netlink.
        nft = shutil.which("nft")
        if nft is None:
            raise LabError(
                "loss_pct/duplicate_pct/reorder_pct need the nft tool "
                "(Debian: apt-get install nftables)"
            )
        cmd = ["ip", "netns", "exec", ns_name, nft, "-f", "-"]
        done = subprocess.run(cmd, input=script, text=True, capture_output=True, timeout=10)
        if done.returncode != 0:
            raise LabError(
                f"{ns_name}: nft failed ({done.stderr.strip()}); loss_pct needs the nf_tables "
                "bridge family (CONFIG_NF_TABLES_BRIDGE) and numgen (CONFIG_NFT_NUMGEN), "
                "duplicate_pct/reorder_pct the netdev egress hook (CONFIG_NETFILTER_EGRESS, "
                "CONFIG_NF_TABLES_NETDEV) and dup (CONFIG_NF_DUP_NETDEV)"
            )
