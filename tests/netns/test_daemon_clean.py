"""`reductionctl clean` on an emulated rack: it refuses to touch a live daemon's rules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from reduction_appliance.deploy.testnet.harness import LabNetwork, start_appliance

pytestmark = pytest.mark.slow  # a lab and a real daemon: seconds


def test_clean_on_a_live_daemon_changes_nothing_and_says_why() -> None:
    groups = "239.255.128.0/17"  # narrower than the lab's own route: the daemon's to hold
    with LabNetwork.rack(1) as net:
        ifname = net.lab.interface_of("a0")
        with start_appliance(net, interface=ifname, groups=groups) as appliance:
            route = net.lab.run("a0", ["ip", "route", "show", groups]).stdout.strip()
            assert ifname in route
            done = net.lab.run("a0", [sys.executable, "-m", "reduction_appliance.control.cli",
                                      "clean", "--config", str(appliance.config_path)],
                               check=False)
            assert done.returncode == 1, (done.stdout, done.stderr)
            assert "is running" in done.stderr and "nothing was changed" in done.stderr
            assert done.stdout == ""
            assert net.lab.run("a0", ["ip", "route", "show", groups]).stdout.strip() == route
            assert Path(appliance.unix_socket).is_socket()
            assert appliance.status()["steering"]  # still serving, still steering
            assert appliance.process.poll() is None
