"""Prometheus's `promtool` and `prometheus`, for the tests of deploy/prometheus/alerts.yml.

On PATH if the machine has them; otherwise, as root with apt, taken out of Debian's
`prometheus` package (`apt-get download`, unpacked, nothing installed: that package's
post-install would start a Prometheus server of its own) into the same cache as the soft-RoCE
guest's kernel. Each is one static binary of about 48 MB; the package's download took under a
second on the development machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("REDUCTION_PROMETHEUS_CACHE",
                            "/var/cache/reduction-appliance/prometheus"))
TOOLS = ("promtool", "prometheus")


def prometheus_tool(name: str) -> tuple[Path | None, str]:
    """The binary `name` (one of `TOOLS`), or None and why there is none here."""
    assert name in TOOLS, name
    if (found := shutil.which(name)) is not None:
        return Path(found), ""
    cached = CACHE / name
    if cached.is_file():
        return cached, ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, (f"no {name} on PATH, and no apt-get as root to take it from Debian's "
                      "prometheus package")
    try:
        _unpack_from_debian()
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return None, f"{name} could not be taken from Debian's prometheus package: {exc}"
    return cached, ""


def _unpack_from_debian() -> None:
    with tempfile.TemporaryDirectory() as work:
        def download() -> subprocess.CompletedProcess[str]:
            return subprocess.run(["apt-get", "download", "-q", "prometheus"], cwd=work,
                                  capture_output=True, text=True, timeout=300, check=False)

        got = download()
        if got.returncode != 0:  # a fresh container has no package lists yet
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300,
                           check=True)
            got = download()
        if got.returncode != 0:
            raise OSError(f"apt-get download prometheus: {got.stderr.strip()[-300:]}")
        (deb,) = Path(work).glob("prometheus_*.deb")
        unpacked = Path(work) / "root"
        unpacked.mkdir()
        members = [f"./usr/bin/{name}" for name in TOOLS]
        subprocess.run(f"dpkg-deb --fsys-tarfile {deb} | tar -x -C {unpacked} {' '.join(members)}",
                       shell=True, check=True, timeout=300)
        CACHE.mkdir(parents=True, exist_ok=True)
        for name in TOOLS:
            staged = CACHE / f"{name}.partial"
            shutil.copy2(unpacked / "usr" / "bin" / name, staged)
            staged.replace(CACHE / name)  # whole or absent: a run killed midway leaves no half
