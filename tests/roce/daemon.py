"""A real reductiond with RoCE for the tests here: its API and core on rxe1 (10.77.0.1)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from reduction_appliance.deploy.testnet.harness import LocalDaemon, local_daemon

SEGMENT = 64 * 1024
# The guest emulates its CPU: a process start takes seconds there, so bounds are generous.
START_S = 180.0

Appliance = LocalDaemon


@contextlib.contextmanager
def appliance(base_port: int = 7000, liveness_s: float = 5.0,
              deadline_s: float = 60.0) -> Iterator[Appliance]:
    with local_daemon({
        "dataplane": {"address": "10.77.0.1", "base_port": base_port, "kernels": "numpy",
                      # room for every test's jobs at once: failed ones stay until evicted
                      "slot_memory_mb": 64, "rx_buffers": 256, "core_start_timeout_s": START_S,
                      "core_reply_timeout_s": 60.0},
        "multicast": {"groups": "239.255.77.0/28"},  # for RoCE jobs that ask (UD)
        "jobs": {"slots": 8, "liveness_timeout_s": liveness_s, "hold_buffers": 64,
                 "deadline_s": deadline_s},
        "roce": {"device": "rxe1", "segment_bytes": SEGMENT},
        "api": {"listen": "10.77.0.1:0"},
    }, ready_s=START_S) as daemon:
        yield daemon
