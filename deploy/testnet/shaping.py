"""Link impairments: qdiscs on veth egress, and nftables rules on the switch and the hosts.

Each direction of a link is shaped on the egress of the veth end that sends it: the host-side
end for host -> switch, the switch-side port for switch -> host. What does what:

* rate: tbf, or the root class of the reordering HTB tree below when reordering is asked;
* delay: sch_netem (with duplicate/reorder done by netem as well); there is no fallback;
* loss: random drops in the switch's bridge forward chain (nftables), see :func:`loss_ruleset`;
* duplicate and reorder without delay: no netem needed (it is missing on many cloud/VM
  kernels), see :func:`egress_ruleset` and :func:`apply_qdiscs`. The same mechanism is used
  whether or not the kernel has netem, so a test behaves alike on every machine.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from reduction_appliance.deploy.testnet.topology import Link

# Any kernel tick is <= 1/100 s; a bucket holding 1/100 s of traffic keeps tbf from
# under-shooting the rate when the qdisc watchdog fires late. 64 KiB floor: several jumbo frames
# and a whole 64 KiB GSO super-packet fit, so tbf never has to split or stall on one.
_BURST_TICK_HZ = 100
_MIN_BURST = 64 * 1024
# Queue bound for tbf, expressed as time at the shaped rate (like tc's "latency").
_TBF_LATENCY_S = 0.05
# netem's default 1000-packet queue drops at high rate x delay products; losses must come only
# from loss_pct.
_NETEM_LIMIT = 100_000

# Reordering without netem (see apply_qdiscs). HTB handles and classes:
_HTB_ROOT = 0x10000  # 1:
_HTB_LINK = 0x10001  # 1:1   the link: rate = ceil = Link.rate (or _UNSHAPED_BPS)
_HTB_FAST = 0x10010  # 1:10  default class, may use the whole link
_HTB_SLOW = 0x10020  # 1:20  held-back packets, paced at a small rate of their own
SLOW_CLASS = "1:20"  # the same, as nftables' `meta priority set` writes it
# Rate assumed for sizing the slow class when the link has no rate; also what a sender may
# sustain through an unshaped reordering link before the held-back share becomes the bottleneck
# (x 1.5 / reorder fraction, see slow_rate_bps).
_NOMINAL_BPS = 10**9
# Ceiling of an unshaped link's HTB tree: far above what veth moves.
_UNSHAPED_BPS = 10**12
# The slow class gets 1.5x the held-back share of the link: busy enough that, while the link is
# busy, a held-back packet usually waits for an earlier one (and later fast packets overtake
# it), yet never a bottleneck at the link rate.
_SLOW_SHARE_FACTOR = 1.5
# ... but never so slow that one held-back frame waits more than this (tiny reorder_pct).
_SLOW_MAX_HOLD_S = 0.02
# The slow leaf holds the backlog of a whole burst: drops must come only from loss_pct. The
# fast leaf is bounded like tbf (_TBF_LATENCY_S of full frames), but never below veth's default
# txqueuelen, which is what an unshaped link would queue.
_SLOW_LEAF_LIMIT = 10_000
_FAST_LEAF_MIN_LIMIT = 1000
_HTB_QUANTUM = 60_000  # bytes per DRR round; explicit, so HTB never warns about r2q
_ETH_HLEN = 14

# Marks a duplicate made by our egress rule so that its own pass through the same hook does not
# duplicate it again. veth scrubs marks when the frame crosses into the peer's namespace.
DUP_MARK = 0x40000000


class ShapingUnsupportedError(RuntimeError):
    """The running kernel lacks a qdisc the topology asks for."""


def tbf_params(rate_bps: int, mtu: int) -> dict[str, int]:
    """tbf parameters in pyroute2's units: rate in bytes/s, burst and limit in bytes."""
    rate = rate_bps // 8
    burst = max(_MIN_BURST, rate // _BURST_TICK_HZ, 2 * mtu)
    return {"rate": rate, "burst": burst, "limit": int(rate * _TBF_LATENCY_S) + burst}


def slow_rate_bps(link: Link) -> int:
    """Rate of the class holding back reorder_pct of the packets (bits/s)."""
    link_bps = link.rate_bps or _NOMINAL_BPS
    frame_bits = (link.mtu + _ETH_HLEN) * 8
    share = _SLOW_SHARE_FACTOR * link.reorder_pct / 100 * link_bps
    return int(min(max(share, frame_bits / _SLOW_MAX_HOLD_S), link_bps / 2))


def _require(exc: NetlinkError, what: str) -> None:
    if exc.code == errno.ENOENT:
        raise ShapingUnsupportedError(f"kernel lacks {what}") from exc


def apply_qdiscs(ipr: Any, index: int, link: Link) -> None:
    """Install the egress qdiscs one direction of ``link`` needs on device ``index``.

    * delay: netem root (also doing duplicate/reorder) with tbf as its child for the rate, the
      layout the netem documentation gives: packets are delayed first, then paced;
    * reorder without delay: the HTB tree of :func:`_apply_reorder_htb`;
    * otherwise tbf root for the rate, or nothing.

    Duplication without delay is no qdisc: it is an nftables rule, see :func:`egress_ruleset`.
    """
    if link.uses_netem:
        _apply_netem(ipr, index, link)
    elif link.reorder_pct > 0:
        _apply_reorder_htb(ipr, index, link)
    else:
        _apply_tbf(ipr, index, link, parent=None)


def _apply_netem(ipr: Any, index: int, link: Link) -> None:
    try:
        ipr.tc(
            "add",
            "netem",
            index,
            handle="1:",
            delay=int(link.delay_ms * 1000),  # microseconds
            duplicate=link.duplicate_pct,
            prob_reorder=link.reorder_pct,
            limit=_NETEM_LIMIT,
        )
    except NetlinkError as exc:
        _require(exc, "sch_netem (CONFIG_NET_SCH_NETEM), needed for delay_ms")
        raise
    _apply_tbf(ipr, index, link, parent="1:1")


def _apply_tbf(ipr: Any, index: int, link: Link, parent: str | None) -> None:
    rate_bps = link.rate_bps
    if rate_bps is None:
        return
    params = tbf_params(rate_bps, link.mtu)
    try:
        if parent is None:
            ipr.tc("add", "tbf", index, handle="1:", **params)
        else:
            ipr.tc("add", "tbf", index, parent=parent, handle="10:", **params)
    except NetlinkError as exc:
        _require(exc, "sch_tbf (CONFIG_NET_SCH_TBF)")
        raise


def _apply_reorder_htb(ipr: Any, index: int, link: Link) -> None:
    """HTB root 1: -> link class 1:1 (rate = ceil = link rate) -> fast 1:10 and slow 1:20.

    The egress nftables chain (:func:`egress_ruleset`) sets skb->priority to 1:20 on
    reorder_pct of the IPv4 packets, which HTB takes as the class to use. The fast class may
    use the whole link; the slow class only its own small rate, with a one-frame bucket, so
    while traffic flows a held-back packet waits for the ones held back before it and later
    packets of the fast class overtake it: real reordering, without netem's timed delay.
    Nothing is dropped for it (deep leaf queues) and the link rate still holds: both classes
    draw from the link class.

    The amount of reordering depends on load: a packet alone on an idle link is never held
    (a token bucket lets a lone packet through at once), and there is nothing to overtake it.
    When a shaped link is saturated the sign flips: the slow class's own share lets held-back
    packets pass the fast class's queue, which is still reordering.
    """
    link_bps = link.rate_bps or _UNSHAPED_BPS
    slow_bps = slow_rate_bps(link)
    frame = link.mtu + _ETH_HLEN
    link_rate = link_bps // 8
    link_burst = max(_MIN_BURST, link_rate // _BURST_TICK_HZ, 2 * frame)
    classes: list[tuple[int, dict[str, int]]] = [
        (_HTB_LINK, {"parent": _HTB_ROOT, "rate": link_rate, "burst": link_burst}),
        (
            _HTB_FAST,
            {
                "parent": _HTB_LINK,
                "rate": (link_bps - slow_bps) // 8,
                "ceil": link_rate,
                "burst": link_burst,
                "cburst": link_burst,
                "prio": 0,
            },
        ),
        (
            _HTB_SLOW,
            {
                "parent": _HTB_LINK,
                "rate": slow_bps // 8,
                "ceil": slow_bps // 8,
                "burst": frame,
                "cburst": frame,
                "prio": 1,
            },
        ),
    ]
    try:
        ipr.tc("add", "htb", index, _HTB_ROOT, default=_HTB_FAST & 0xFFFF)
    except NetlinkError as exc:
        _require(exc, "sch_htb (CONFIG_NET_SCH_HTB), needed for reorder_pct")
        raise
    for classid, params in classes:
        if "ceil" not in params:
            params = {**params, "ceil": params["rate"], "cburst": params["burst"]}
        ipr.tc("add-class", "htb", index, classid, quantum=_HTB_QUANTUM, **params)
    fast_limit = _FAST_LEAF_MIN_LIMIT
    if link.rate_bps is not None:
        fast_limit = max(fast_limit, tbf_params(link.rate_bps, link.mtu)["limit"] // frame)
    for classid, limit in ((_HTB_FAST, fast_limit), (_HTB_SLOW, _SLOW_LEAF_LIMIT)):
        handle = (classid & 0xFFFF) << 16  # 10: under 1:10, 20: under 1:20
        ipr.tc("add", "pfifo", index, handle, parent=classid, limit=limit)


def egress_ruleset(devices: Mapping[str, Link], table: str = "testnet_impair") -> str:
    """nftables script for duplication and reorder classification on the egress of ``devices``
    (all in one namespace); empty when none of them needs it.

    One netdev-family egress chain per device, running before the device's qdisc:

    * reorder_pct of the IPv4 packets get skb->priority = 1:20, the slow class of the HTB tree
      :func:`apply_qdiscs` put on that device;
    * duplicate_pct of the IPv4 packets are cloned and the clone sent out of the same device.
      The clone goes through this chain again (marked, so it is not duplicated in turn) and
      through the same qdisc, so duplicates obey the link rate and share the original's class.

    Duplicating on the sending end of each direction means the copy takes the original's path:
    a worker's unicast to any host, and each flooded copy of a multicast frame on its way out
    of the switch port to that worker. Only IPv4 is touched, never ARP. GSO super-packets
    (TCP) are duplicated or held back whole.
    """
    scale = 1_000_000
    chains = []
    for dev, link in sorted(devices.items()):
        if not link.nft_impaired:
            continue
        keep = f"0x{~DUP_MARK & 0xFFFFFFFF:08x}"
        rules = [
            f"meta mark & 0x{DUP_MARK:08x} == 0x{DUP_MARK:08x} meta mark set meta mark & {keep}"
            " accept"
        ]
        if link.reorder_pct > 0:
            threshold = round(link.reorder_pct / 100 * scale)
            rules.append(
                f"meta protocol ip numgen random mod {scale} < {threshold} "
                f"meta priority set {SLOW_CLASS}"
            )
        if link.duplicate_pct > 0:
            threshold = round(link.duplicate_pct / 100 * scale)
            rules.append(
                f"meta protocol ip numgen random mod {scale} < {threshold} "
                f'meta mark set meta mark | 0x{DUP_MARK:08x} dup to "{dev}" '
                f"meta mark set meta mark & {keep}"
            )
        body = "".join(f"    {rule}\n" for rule in rules)
        chains.append(
            f"  chain egress_{dev} {{\n"
            f'    type filter hook egress device "{dev}" priority 0; policy accept;\n'
            f"{body}"
            "  }\n"
        )
    if not chains:
        return ""
    return f"table netdev {table} {{\n" + "".join(chains) + "}\n"


def loss_ruleset(ports: dict[str, float], table: str = "testnet") -> str:
    """An nftables script dropping packets at random on the given switch ports, both directions.

    Loss lives in the switch rather than in netem because sch_netem is often not built (it is
    missing on some cloud/VM kernels) while nf_tables is nearly always there; one code path then
    works everywhere. A frame between two lossy ports is exposed twice, as on two lossy cables.
    Only IPv4 is dropped, never ARP: a lost ARP exchange stalls a link for a whole second of
    neighbour retries, which turns "1% loss" into random multi-second outages and flaky tests.
    A TCP GSO super-packet is dropped whole; UDP datagrams are one frame each (the lab turns
    UDP segmentation offload off on every host link: see lab._like_a_nic).
    """
    scale = 1_000_000
    rules = []
    for port, pct in sorted(ports.items()):
        if pct <= 0:
            continue
        threshold = round(pct / 100 * scale)
        for match in ("iifname", "oifname"):
            rules.append(
                f'    ether type ip {match} "{port}" numgen random mod {scale} < {threshold} drop'
            )
    body = "\n".join(rules)
    return (
        f"table bridge {table} {{\n"
        "  chain forward {\n"
        "    type filter hook forward priority 0; policy accept;\n"
        f"{body}\n"
        "  }\n"
        "}\n"
    )
