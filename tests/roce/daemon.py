"""A real reductiond with RoCE for the tests here: its API and core on rxe1 (10.77.0.1)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from reduction_appliance.control.config import parse, to_toml
from reduction_appliance.deploy.testnet.harness import DAEMON, OutputTail

SEGMENT = 64 * 1024
# The guest emulates its CPU: a process start takes seconds there, so bounds are generous.
START_S = 180.0


@dataclass
class Appliance:
    process: subprocess.Popen[str]
    api: str
    unix_socket: str
    stderr: OutputTail


@contextlib.contextmanager
def appliance(base_port: int = 7000, liveness_s: float = 5.0,
              deadline_s: float = 60.0) -> Iterator[Appliance]:
    tmp = tempfile.mkdtemp(prefix="rd-")
    try:
        sock = str(Path(tmp) / "api.sock")
        cfg = parse({"dataplane": {"address": "10.77.0.1", "base_port": base_port,
                                   "kernels": "numpy",
                                   "slot_memory_mb": 16, "rx_buffers": 256,
                                   "core_start_timeout_s": START_S,
                                   "core_reply_timeout_s": 60.0},
                     "multicast": {"enabled": False},
                     "jobs": {"slots": 8, "liveness_timeout_s": liveness_s, "hold_buffers": 64,
                              "deadline_s": deadline_s},
                     "roce": {"device": "rxe1", "segment_bytes": SEGMENT},
                     "api": {"listen": "10.77.0.1:0", "unix_socket": sock}})
        path = Path(tmp) / "appliance.toml"
        path.write_text(to_toml(cfg))
        proc = subprocess.Popen([sys.executable, *DAEMON, "--config", str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        out, err = OutputTail(proc.stdout, marker="reductiond ready"), OutputTail(proc.stderr)
        try:
            assert out.seen.wait(START_S) and out.line, f"not ready: {err.text()}"
            found = re.search(r"api ([\d.]+):(\d+)", out.line)
            assert found, out.line
            yield Appliance(proc, f"{found.group(1)}:{found.group(2)}", sock, err)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
