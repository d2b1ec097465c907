"""deploy/prometheus/alerts.yml: its metrics exist, its label values are real, and its alerts
fire where they should and nowhere else (promtool's own checks and unit tests)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from reduction_appliance.control.metrics import DROP_REASONS
from reduction_appliance.dataplane.spec import CoreState
from tests.prometheus_tools import prometheus_tool
from tests.unit.test_metrics import samples

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = RULES.with_name("alerts.test.yml")


def test_every_metric_the_rules_name_is_one_the_appliance_exports() -> None:
    exported = {s.name for s in samples()}
    named = set(re.findall(r"\breduction_[a-z_]+", RULES.read_text()))
    assert named, "no metric found in the rules"
    assert named <= exported, f"not exported: {sorted(named - exported)}"


def test_the_label_values_the_rules_compare_with_exist() -> None:
    text = RULES.read_text()
    states = set(re.findall(r'state!?="([a-z_]+)"', text))
    assert states and states <= {s.value for s in CoreState}, states
    reasons = {r for found in re.findall(r'reason=~?"([a-z_|]+)"', text)
               for r in found.split("|")}
    assert reasons and reasons <= set(DROP_REASONS), sorted(reasons - set(DROP_REASONS))


@pytest.fixture(scope="module")
def promtool_binary() -> Path:
    binary, why = prometheus_tool("promtool")
    if binary is None:
        pytest.skip(f"this machine lacks promtool: {why}")
    return binary


def test_promtool_accepts_the_rules(promtool_binary: Path) -> None:
    checked = subprocess.run([str(promtool_binary), "check", "rules", str(RULES)],
                             capture_output=True, text=True, timeout=120, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 12 rules found" in checked.stdout


def test_each_alert_fires_on_a_sick_appliance_and_not_on_a_healthy_one(
        promtool_binary: Path) -> None:
    tested = subprocess.run([str(promtool_binary), "test", "rules", RULE_TESTS.name],
                            cwd=RULES.parent, capture_output=True, text=True, timeout=120,
                            check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = set(re.findall(r"^\s+- alert: (\w+)$", RULES.read_text(), re.MULTILINE))
    exercised = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert alerts and alerts == exercised, sorted(alerts ^ exercised)
