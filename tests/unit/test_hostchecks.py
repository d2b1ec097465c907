"""What a worker checks of its own host as it joins (plugin/hostchecks.py), on real sockets."""

from __future__ import annotations

import logging
import socket

import pytest

from reduction_appliance.plugin.hostchecks import buffer_window
from reduction_appliance.plugin.transport import UdpWorkerTransport

SEGMENT = 8896


def transport_with_buffer(nbytes: int | None) -> UdpWorkerTransport:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if nbytes is not None:  # what a process that is not root gets on a stock kernel
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)
    return UdpWorkerTransport.over([sock])


def test_a_stock_hosts_receive_buffer_holds_the_windows_and_says_how_to_raise_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """rmem_max's default, 212992 (the kernel doubles it): 416 KiB hold 43 coalesced results
    of a jumbo-frame job's segments, 21 a core, not the 32 slots; said once, with the fix."""
    with transport_with_buffer(212992) as udp:
        if udp.receive_buffer != 2 * 212992:
            pytest.skip(f"this kernel granted {udp.receive_buffer} bytes for 212992 asked "
                        "(net.core.rmem_max below its default)")
        with caplog.at_level(logging.WARNING):
            assert buffer_window(udp, 32, 2, SEGMENT, 3) == 21
            assert buffer_window(udp, 32, 2, SEGMENT, 3) == 21
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said  # once per process
    assert said[0].startswith("rank 3: this host gives UDP sockets 416 KiB of receive buffer "
                              "(net.core.rmem_max caps a process that is not root)"), said
    assert "windows held to 21 segments per appliance core, of 32 slots" in said[0]
    assert "sysctl -w net.core.rmem_max=67108864 net.core.wmem_max=67108864" in said[0]


def test_a_tuned_hosts_buffer_leaves_the_windows_alone() -> None:
    with transport_with_buffer(None) as udp:
        try:
            udp.sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33),
                                32 << 20)
        except PermissionError:
            pytest.skip("forcing a receive buffer past net.core.rmem_max needs root "
                        "(CAP_NET_ADMIN)")
        assert buffer_window(udp, 32, 2, SEGMENT, 0) is None
