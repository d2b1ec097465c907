"""Prometheus's `promtool`, for the tests of deploy/prometheus/alerts.yml.

On PATH if the machine has it; otherwise, as root with apt, taken out of Debian's `prometheus`
package (`apt-get download`, unpacked, nothing installed: that package's post-install would
start a Prometheus server) into the same cache as the soft-RoCE guest's kernel. It is one
static binary of 48 MB; the package's download took under a second on the development machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("REDUCTION_PROMTOOL_CACHE",
                            "/var/cache/reduction-appliance/promtool"))
_BINARY = CACHE / "usr" / "bin" / "promtool"


def promtool() -> tuple[Path | None, str]:
    """The promtool binary, or None and why there is none here."""
    if (found := shutil.which("promtool")) is not None:
        return Path(found), ""
    if _BINARY.is_file():
        return _BINARY, ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, ("no promtool on PATH, and no apt-get as root to take it from Debian's "
                      "prometheus package")
    try:
        _unpack_from_debian()
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"promtool could not be taken from Debian's prometheus package: {exc}"
    return _BINARY, ""


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
        subprocess.run(f"dpkg-deb --fsys-tarfile {deb} | tar -x -C {unpacked} ./usr/bin/promtool",
                       shell=True, check=True, timeout=300)
        _BINARY.parent.mkdir(parents=True, exist_ok=True)
        staged = _BINARY.with_suffix(".partial")
        shutil.copy2(unpacked / "usr" / "bin" / "promtool", staged)
        staged.replace(_BINARY)  # whole or absent: a run killed midway leaves no half binary
