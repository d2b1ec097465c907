"""What this machine lets the tests do, for the tests that must skip without it (saying so)."""

from __future__ import annotations

import pytest

from reduction_appliance.dataplane.icmpwatch import IcmpWatch


def raw_icmp_refused() -> str:
    """Why this process may not open the raw ICMP socket an appliance core reads ended
    workers' closed ports from ("" where it may)."""
    watch = IcmpWatch.open(("127.0.0.1", 0))
    if isinstance(watch, str):
        return watch
    watch.close()
    return ""


needs_raw_icmp = pytest.mark.skipif(
    bool(raw_icmp_refused()), reason="the appliance's cores read ICMP port unreachable from a "
    "raw socket, and this machine refuses one (CAP_NET_RAW)")
