"""The shape of the product: one import root, imports that point one way, and the operator's
check of a config file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from reduction_appliance.control.cli import main as reductionctl
from reduction_appliance.control.hostfit import host_memory_bytes

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "deploy" / "appliance.toml"
_LOADED = """
import json, sys
import reduction_appliance.control.cli as cli
import reduction_appliance.control.daemon
cli._parser()
print(json.dumps(sorted(sys.modules)))
"""


def test_the_control_plane_loads_no_lab_bench_or_worker_code() -> None:
    done = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True,
                          timeout=60, check=True, cwd="/")
    loaded = json.loads(done.stdout)
    above = [m for m in loaded if m.startswith((
        "reduction_appliance.bench", "reduction_appliance.deploy", "reduction_appliance.plugin",
        "torch", "matplotlib"))]
    assert above == []
    # Everything of ours comes through the one root: no top-level dataplane/control/... copy.
    assert not [m for m in loaded
                if m.split(".")[0] in {"dataplane", "control", "plugin", "deploy", "bench"}]
    assert "reduction_appliance.dataplane.wire" in loaded


def test_reductionctl_status_starts_without_numpy_pyroute2_or_pyverbs() -> None:
    """An operator's `reductionctl status` talks to the daemon's socket and prints: numpy,
    pyroute2 and pyverbs (a third of a second here, 17 s in the emulated RoCE guest) are
    loaded only by the commands that use them (check-config, clean)."""
    script = ("import json, sys; import reduction_appliance.control.cli as cli; cli._parser(); "
              "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True, cwd="/")
    heavy = {m.split(".")[0] for m in json.loads(done.stdout)} & {"numpy", "pyroute2", "pyverbs"}
    assert heavy == set()


@pytest.mark.slow
def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    # Built from a copy (links kept): setuptools writes build/ next to the sources.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"reduction_appliance"}
    for package in ("dataplane", "control", "plugin", "deploy", "bench"):
        assert f"reduction_appliance/{package}/__init__.py" in names
    assert "reduction_appliance/torch.py" in names


def test_check_config_names_a_bad_kernels_value(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "appliance.toml"
    bad.write_text(REFERENCE.read_text().replace('kernels = "auto"', 'kernels = "tourch"'))
    assert reductionctl(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "dataplane.kernels" in err and "tourch" in err and "numpy+ml_dtypes" in err
    assert reductionctl(["check-config", str(REFERENCE)]) == 0
    assert "config OK" in capsys.readouterr().out


def test_check_config_refuses_slot_memory_the_host_does_not_have(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A core once failed at its start with a bare "OSError: [Errno 12] Cannot allocate
    memory" after check-config said OK."""
    host = host_memory_bytes()
    if host is None:
        pytest.skip("this host has no /proc/meminfo to size the cores' memory against")
    too_much = host // 2**20 + 1024  # MiB per core: more than the whole host
    bad = tmp_path / "appliance.toml"
    bad.write_text(re.sub(r"slot_memory_mb = \d+", f"slot_memory_mb = {too_much}",
                          REFERENCE.read_text()))
    assert reductionctl(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"dataplane.slot_memory_mb = {too_much} maps" in err and "more than this host" in err
