"""A real Prometheus scrapes a real reductiond as deploy/prometheus/alerts.yml says to (job
"reductiond", the API's bearer token from a file) and evaluates those rules: the scrape is up,
every rule evaluates without an error, a healthy appliance raises nothing, and a stopped one
raises ReductionApplianceDown. (promtool's unit tests, tests/unit/test_alert_rules.py, show
each alert on synthetic series; this shows the rules and the documented scrape meet the real
exposition.)"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reduction_appliance.client import ApplianceClient, register
from reduction_appliance.deploy.testnet.harness import local_daemon
from tests.prometheus_tools import prometheus_tool
from tests.waiting import wait_until

from .ranks import allreduce_once_on_every_rank
from .test_eviction import _free_udp_ports

pytestmark = pytest.mark.slow  # a daemon and a Prometheus server: seconds

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
TOKEN = "token-of-the-prometheus-test"
RUNNING = 'reduction_core_state{state="running"}'


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus_binary() -> Path:
    binary, why = prometheus_tool("prometheus")
    if binary is None:
        pytest.skip(f"this machine lacks a Prometheus server: {why}")
    return binary


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **query: str) -> Any:
        address = f"{self.url}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(address, timeout=5) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def targets_up(self) -> list[str]:
        return [t["health"] for t in self.get("/api/v1/targets")["activeTargets"]]

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.get("/api/v1/rules")["groups"] for r in g["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])

    def raised(self) -> set[str]:
        """The alerts firing or pending, by name."""
        return {a["labels"]["alertname"] for a in self.alerts()}


@contextlib.contextmanager
def _prometheus(binary: Path, tmp: Path, api: str) -> Iterator[Prometheus]:
    (tmp / "scrape-token").write_text(TOKEN)  # as an operator hands Prometheus the API's token
    config = {  # JSON is YAML
        # (a scrape's timeout is its interval: 2 s leaves a busy host room)
        "global": {"scrape_interval": "2s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "reductiond",
            "authorization": {"credentials_file": str(tmp / "scrape-token")},
            "static_configs": [{"targets": [api]}],
        }],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))
    port = _free_tcp_port()
    # its log to a file: a pipe nobody reads could fill and stall it
    with open(tmp / "prometheus.log", "w") as log, subprocess.Popen(
            [str(binary), f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log) as server:
        try:
            yield Prometheus(f"http://127.0.0.1:{port}")
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def _answers(prom: Prometheus) -> bool:
    try:
        prom.get("/api/v1/status/buildinfo")
    except OSError:
        return False
    return True


def test_prometheus_scrapes_the_appliance_and_evaluates_every_rule(
        prometheus_binary: Path, tmp_path: Path) -> None:
    cfg = {
        "dataplane": {"address": "127.0.0.1", "base_port": _free_udp_ports(2), "cores": 2,
                      "cpus": [], "kernels": "numpy", "slot_memory_mb": 4, "mtu": 9000},
        "multicast": {"enabled": False},
        "api": {"listen": f"127.0.0.1:{_free_tcp_port()}",
                "token_file": str(tmp_path / "token")},
    }
    (tmp_path / "token").write_text(TOKEN)
    with local_daemon(cfg) as daemon:
        daemon_fallbacks = _fallbacks(daemon.api)
        # a job that reduces, so that its series exist while the rules are evaluated
        info = register(daemon.api, "scraped", world_size=2, secret="s", token=TOKEN)
        clients = [ApplianceClient([info], rank, local_address="127.0.0.1")
                   for rank in (0, 1)]
        try:
            allreduce_once_on_every_rank(clients, 300_000, 60)
            with _prometheus(prometheus_binary, tmp_path, daemon.api) as prom:
                wait_until(lambda: _answers(prom), 60, what="Prometheus to answer")
                wait_until(lambda: prom.targets_up() == ["up"], 30,
                           what="the appliance's scrape to be up (job reductiond, its token)")
                rules = wait_until(lambda: _evaluated(prom.rules()), 30,
                                   what="every rule evaluated")
                assert len(rules) == 12
                assert [(x["name"], x["health"], x.get("lastError", "")) for x in rules
                        if x["health"] != "ok"] == []
                # A scrape that failed since (CI's busiest minutes once made one overrun its
                # timeout) leaves the series stale until the next: wait for a scrape that came.
                wait_until(lambda: len(prom.get("/api/v1/query", query=RUNNING)["result"]) == 2,
                           30, 0.2, what="both cores' state scraped")
                jobs = prom.get("/api/v1/query", query="reduction_job_segments_reduced_total")
                assert [s["metric"]["name"] for s in jobs["result"]] == ["scraped"], jobs
                # Healthy: nothing fires or is pending (a fallback this host takes, listed by
                # the daemon, is the one thing ReductionFallbacks may be pending for) once the
                # scrapes succeed: a failed one makes ReductionApplianceDown pending, as it
                # should, until the next succeeds.
                allowed = {"ReductionFallbacks"} if daemon_fallbacks else set()
                # (rules evaluated once more, now that the series are there: a rule raising
                # on a healthy appliance is pending from then on)
                before = {r["name"]: r["lastEvaluation"] for r in prom.rules()}
                wait_until(lambda: all(r["lastEvaluation"] != before[r["name"]]
                                       for r in prom.rules()), 30, 0.2,
                           what="every rule evaluated again")
                try:
                    wait_until(lambda: prom.raised() <= allowed, 30, 0.2,
                               what=f"no alert raised but {allowed or 'none'}")
                except TimeoutError as exc:
                    raise AssertionError(f"{exc}; raised: {prom.raised()}") from exc
                daemon.process.terminate()
                daemon.process.wait(30)
                down = wait_until(lambda: [a for a in prom.alerts()
                                           if a["labels"]["alertname"] == "ReductionApplianceDown"],
                                  30, what="ReductionApplianceDown once the daemon stopped")
                assert down[0]["state"] == "pending"  # for a minute before it fires
                assert down[0]["labels"]["instance"] == daemon.api
        finally:
            for client in clients:
                client.close()


def _evaluated(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rules, once each has been evaluated (never: the year 1), else none."""
    done = rules and not any(r["lastEvaluation"].startswith("0001-") for r in rules)
    return rules if done else []


def _fallbacks(api: str) -> list[str]:
    request = urllib.request.Request(f"http://{api}/v1/status",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return list(json.load(answer).get("fallbacks", []))
