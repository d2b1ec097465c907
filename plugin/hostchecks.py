"""What a worker checks of its own host as it joins, and says once per process at most.

- What the kernel refused the UDP transport (coalesced receives, receive times): it works
  without them, slower or less exactly, so that is INFO.
- Routes narrower than the job's segments: they travel as IP fragments (WARNING).
- A receive buffer smaller than a window's burst of results (`buffer_window`): a worker that
  is not root gets what net.core.rmem_max allows, 416 KiB on a stock kernel, and a window's
  burst of results overflowed it (plugin/congestion.py, `fitting_window`). The windows are held
  to what fits, and the WARNING says how to raise the cap.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from reduction_appliance.dataplane.wire import HEADER_SIZE, IP_UDP_HEADERS

from .congestion import fitting_window
from .session import Endpoint
from .transport import UdpWorkerTransport

__all__ = ["buffer_window", "fragmenting_routes", "say_refusals"]

_log = logging.getLogger("reduction_appliance.plugin.client")  # (the client's own words)
_SAID: set[tuple[str, str]] = set()  # (what, why): said once per process


def _first_time(what: str, why: str) -> bool:
    if (what, why) in _SAID:
        return False
    _SAID.add((what, why))
    return True


def say_refusals(udp: UdpWorkerTransport) -> None:
    if udp.gro_refused and _first_time("gro", udp.gro_refused):
        _log.info("fallback: UDP GRO refused by the kernel (%s): one receive call per result "
                  "datagram", udp.gro_refused)
    if udp.stamps_refused and _first_time("stamps", udp.stamps_refused):
        _log.info("fallback: SO_TIMESTAMPNS refused by the kernel (%s): congestion delay "
                  "samples include this host's own wait", udp.stamps_refused)


def fragmenting_routes(udp: UdpWorkerTransport, endpoints: Sequence[Endpoint],
                       segment_bytes: int, rank: int) -> list[str]:
    """The routes to cores that fragment the job's datagrams (the appliance's MTU is larger
    than this host's path), each named once at WARNING."""
    found = udp.fragmenting_routes([e.address for e in endpoints], segment_bytes)
    fresh = [r for r in found if _first_time("fragmenting", r)]
    if fresh:
        _log.warning("rank %d: this host's route to %s is narrower than the job's segments: "
                     "they travel as IP fragments (slower; a lost fragment loses the segment). "
                     "Give the path one MTU end to end, or set the appliance's dataplane.mtu "
                     "to this path's.", rank, ", ".join(fresh))
    return found


def buffer_window(udp: UdpWorkerTransport, slots: int, cores: int, segment_bytes: int,
                  rank: int) -> int | None:
    """The window per core this host's receive buffers hold, results coming from `cores`
    cores, where fewer than their `slots` (said once at WARNING, with the fix); else None."""
    buffer = udp.receive_buffer
    fits = fitting_window(buffer, segment_bytes + HEADER_SIZE + IP_UDP_HEADERS, cores,
                          coalesced=not udp.gro_refused)
    if fits >= slots:
        return None
    if _first_time("rmem", str(buffer)):
        _log.warning("rank %d: this host gives UDP sockets %d KiB of receive buffer "
                     "(net.core.rmem_max caps a process that is not root), less than a "
                     "window's burst of results: windows held to %d segments per appliance "
                     "core, of %d slots, slower on fast links. Raise the cap on every worker "
                     "host: sysctl -w net.core.rmem_max=67108864 net.core.wmem_max=67108864 "
                     "(deploy/host-tuning.md, \"Socket buffers\")", rank, buffer // 1024, fits,
                     slots)
    return fits
