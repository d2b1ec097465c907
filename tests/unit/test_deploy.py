"""Deployment files: the systemd unit parses and says what it must; install.sh is idempotent
and its dry run touches nothing. Installs go under a temporary --prefix, never onto the host."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from reduction_appliance.control.config import load

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "reductiond.service"
INSTALL = DEPLOY / "install.sh"
CAPS = {"CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_SYS_NICE", "CAP_IPC_LOCK"}


def unit() -> configparser.ConfigParser:
    # strict: a repeated key is an error (systemd would merge or override it silently).
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment, method-assign]  # keys are CamelCase
    parser.read_string(UNIT.read_text())
    return parser


def install(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                          timeout=60, check=False)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_unit_has_the_required_keys() -> None:
    u = unit()
    assert set(u.sections()) == {"Unit", "Service", "Install"}
    svc = u["Service"]
    assert svc["ExecStart"] == ("/opt/reduction-appliance/.venv/bin/reductiond "
                                "--config /etc/reduction-appliance/appliance.toml")
    assert set(svc["AmbientCapabilities"].split()) == CAPS
    assert set(svc["CapabilityBoundingSet"].split()) == CAPS
    expected = {
        "User": "reduction", "LimitMEMLOCK": "infinity", "Restart": "on-failure",
        "KillSignal": "SIGTERM", "RuntimeDirectory": "reduction-appliance",
        "StateDirectory": "reduction-appliance", "NoNewPrivileges": "yes",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    }
    assert {key: svc.get(key) for key in expected} == expected
    assert int(svc["TimeoutStopSec"]) > 0 and svc["CPUAffinity"]
    assert "AF_NETLINK" in svc["RestrictAddressFamilies"].split()
    for breaks_the_data_plane in ("PrivateNetwork", "PrivateDevices", "AllowedCPUs"):
        assert breaks_the_data_plane not in svc
    assert u["Install"]["WantedBy"] == "multi-user.target"


def test_unit_has_no_trailing_comments() -> None:
    # systemd would take "yes  # why" as the value; comments must sit on their own lines.
    for line in UNIT.read_text().splitlines():
        assert line.startswith("#") or "#" not in line, line


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    # ExecStart must exist for verify; everything else is checked as written.
    text = re.sub(r"(?m)^ExecStart=.*$", "ExecStart=/bin/true", UNIT.read_text())
    copy = tmp_path / "reductiond.service"
    copy.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0 and "Unknown" not in done.stderr, done.stderr


def test_install_script_parses() -> None:
    subprocess.run(["bash", "-n", str(INSTALL)], check=True)


def test_dry_run_shows_every_step_and_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = install("--dry-run", "--prefix", str(root), "--data-if", "eth1").stdout
    for step in ("useradd --system", "-m venv", "[torch]", "appliance.toml", "token",
                 "reductiond.service", "net.core.rmem_max = 67108864",
                 "net.ipv4.conf.eth1.rp_filter = 2", "daemon-reload", "Next steps"):
        assert step in out, step
    assert not root.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="a real install needs root")
def test_install_into_a_prefix_is_idempotent(tmp_path: Path) -> None:
    root = tmp_path / "root"
    install("--prefix", str(root), "--skip-venv", "--data-if", "eth1")
    etc = root / "etc" / "reduction-appliance"
    token = (etc / "token").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", token)
    assert (etc / "token").stat().st_mode & 0o777 == 0o640
    config = (etc / "appliance.toml").read_text()
    assert 'token_file = "/etc/reduction-appliance/token"' in config
    assert 'interface = "eth1"' in config
    assert load(etc / "appliance.toml").api.token_file == "/etc/reduction-appliance/token"
    unit_file = root / "etc" / "systemd" / "system" / "reductiond.service"
    assert unit_file.read_text() == UNIT.read_text()
    sysctl = (root / "etc" / "sysctl.d" / "60-reduction-appliance.conf").read_text()
    assert "net.core.wmem_max = 67108864" in sysctl and "igmp_max_memberships" in sysctl
    alerts = root / "opt" / "reduction-appliance" / "prometheus" / "alerts.yml"
    assert alerts.read_text() == (DEPLOY / "prometheus" / "alerts.yml").read_text()

    (etc / "appliance.toml").write_text("# the operator's own\n")
    again = install("--prefix", str(root), "--skip-venv").stdout
    assert "exists: kept" in again
    assert (etc / "token").read_text() == token
    assert (etc / "appliance.toml").read_text() == "# the operator's own\n"


def test_refuses_without_root(tmp_path: Path) -> None:
    argv = ["bash", str(INSTALL), "--prefix", str(tmp_path / "root"), "--skip-venv"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root")
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode in (126, 127) and "Permission denied" in done.stderr:
        pytest.skip("the checkout is not readable by nobody")
    assert done.returncode == 1, done.stderr
    assert "must run as root" in done.stderr
    assert not (tmp_path / "root").exists()


def test_unknown_option_is_rejected() -> None:
    done = install("--frobnicate", check=False)
    assert done.returncode == 2 and "unknown option --frobnicate" in done.stderr
