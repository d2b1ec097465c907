"""Ranks of one job reducing together on loopback, one thread each."""

from __future__ import annotations

import threading

import numpy as np

from reduction_appliance.client import ApplianceClient


def allreduce_once_on_every_rank(clients: list[ApplianceClient], elements: int,
                                 timeout_s: float) -> None:
    """Rank r reduces `elements` values of r + 1 with every other rank at once; every rank
    must end with their exact sum."""
    arrays = [np.full(elements, rank + 1.0, np.float32) for rank in range(len(clients))]
    threads = [threading.Thread(target=client.allreduce, args=(array,))
               for client, array in zip(clients, arrays, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    total = sum(range(1, len(clients) + 1))
    assert all(np.array_equal(x, np.full(elements, total, np.float32)) for x in arrays)
