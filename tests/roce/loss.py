"""Loss injected into the soft-RoCE lab's network (deploy/roce/rxe-net.sh): nftables rules on
the workers' links, removed whatever happens."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def multicast_loss(every: int, devices: tuple[str, ...] = ("h2", "h3", "h4")) -> Iterator[None]:
    """Drop every `every`-th RoCE multicast packet arriving on each worker's link (the lab's
    veth ends; rxe.net.sh). Not at the sender: rxe retries a packet its own host refused to
    send, which is no loss at all."""
    if shutil.which("nft") is None:
        pytest.skip("this machine has no nft to inject loss with")
    chains = "".join(
        f" chain {d} {{\n  type filter hook ingress device \"{d}\" priority 0;\n"
        f"  ip daddr 239.255.0.0/16 udp dport 4791 numgen inc mod {every} == 0 counter drop\n"
        " }\n" for d in devices)
    subprocess.run(["nft", "-f", "-"], input=f"table netdev ra_loss {{\n{chains}}}\n",
                   text=True, check=True)
    try:
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "netdev", "ra_loss"], check=True)
