"""The lease: a thread that keeps telling the appliances this rank is alive.

Liveness must not depend on the application being inside an allreduce: a rank busy in a long
forward pass, or idle between steps, still heartbeats from this thread. It only sends (the
transport's `send_raw` is safe from another thread); the answers are read by whoever drives
the client, with its next allreduce.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from reduction_appliance.dataplane.wire import HEADER_SIZE, DType, Header, Kind, Op, pack_into

from .rendezvous import JobInfo

__all__ = ["Lease", "heartbeat"]


def heartbeat(job: JobInfo, rank: int, seq: int, epoch: int) -> bytes:
    """The HEARTBEAT datagram number `seq` of `rank` in a joined `job` (the answer, LIVENESS,
    names the job's silent ranks: plugin/pipeline.py)."""
    assert job.cookie is not None
    header = bytearray(HEADER_SIZE)
    pack_into(header, Header(Kind.HEARTBEAT, DType.FLOAT32, Op.SUM, 0, job.job_id, rank,
                             job.cookie, seq % 2**32, 0, 0, 0, 0, epoch))
    return bytes(header)


class Lease:
    """Calls `beat()` now and then every `interval_s` until `stop()`."""

    def __init__(self, beat: Callable[[], None], interval_s: float, name: str) -> None:
        self._beat = beat
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._beat()
            if self._stopped.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
