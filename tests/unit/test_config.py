"""Configuration and job registration: values in, values or named errors out."""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from reduction_appliance.control.config import HostPort, load, parse, to_toml
from reduction_appliance.control.registry import ConflictError, JobRequest, Registry
from reduction_appliance.dataplane.errors import BadRequest, ConfigError
from reduction_appliance.dataplane.registration import JobDescription, SchemaError

REFERENCE = Path(__file__).resolve().parents[2] / "deploy" / "appliance.toml"


def test_reference_config_loads() -> None:
    cfg = load(REFERENCE)
    assert cfg.dataplane.cores == 2 and cfg.dataplane.max_payload == 8896
    assert cfg.source == str(REFERENCE)


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"dataplane": {"cores": 0}}, "dataplane.cores"),
        ({"dataplane": {"corse": 2}}, "dataplane.corse: unknown key"),
        ({"dataplane": {"cores": 2, "cpus": [0]}}, "dataplane.cpus"),
        ({"dataplane": {"poll": "lazy"}}, "dataplane.poll"),
        ({"dataplane": {"address": "not-an-ip"}}, "dataplane.address"),
        ({"dataplane": {"mtu": 1500, "segment_bytes": 8192}}, "dataplane.segment_bytes"),
        ({"dataplane": {"mtu": "9000"}}, "dataplane.mtu: expected int"),
        ({"multicast": {"groups": "10.0.0.0/8"}}, "multicast.groups: .* not a multicast"),
        ({"multicast": {"groups": "239.255.0.1/16"}}, "multicast.groups"),
        ({"dataplane": {"dscp": 64}}, "dataplane.dscp"),
        ({"dataplane": {"base_port": 65535}}, "dataplane.base_port"),
        ({"dataplane": {"kernels": "tensorflow"}}, "dataplane.kernels: must be one of"),
        ({"dataplane": {"kernels": "Torch"}}, "dataplane.kernels"),
        ({"jobs": {"slots": 100000}}, "jobs.slots"),
        ({"jobs": {"queue_target_s": -0.01}}, "jobs.queue_target_s: must be 0..10"),
        ({"api": {"listen": "localhost"}}, "api.listen"),
        ({"dataplan": {}}, "dataplan: unknown section"),
    ],
)
def test_errors_name_the_key(raw: dict[str, dict[str, object]], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        parse(raw)


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[dataplane]\ncores = 0\n")
    with pytest.raises(ConfigError, match=f"^{bad}: dataplane.cores: must be 1..64$"):
        load(bad)  # the file named, as for the errors reading it
    bad.write_text("[dataplane\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(bad)
    binary = tmp_path / "binary.toml"  # (a UnicodeDecodeError traceback once)
    binary.write_bytes(b"[dataplane]\ncores = 2\n\x7fELF\xd0\x01")
    with pytest.raises(ConfigError, match=r"not valid TOML: not UTF-8 text .* at byte 26"):
        load(binary)


def test_registration_is_idempotent_and_refuses_disagreement() -> None:
    registry = Registry(parse({}))
    plan = registry.plan(JobRequest("job", 4), cookie=7, secret="s", now=0.0)
    registry.commit(plan)
    again = registry.plan(JobRequest("job", 4), cookie=8, secret="s", now=0.0)
    assert again is plan  # the other ranks
    with pytest.raises(ConflictError, match="exists"):
        registry.plan(JobRequest("job", 8), cookie=9, secret="s", now=0.0)
    other = registry.plan(JobRequest("other", 2), cookie=10, secret="t", now=0.0)
    registry.commit(other)
    assert other.spec.job_id != plan.spec.job_id
    assert other.spec.multicast != plan.spec.multicast  # one group per job
    described = plan.describe(registry.cfg, member=True)
    assert described.cookie == 7 and described.public().cookie is None
    assert described.segment_bytes == parse({}).dataplane.max_payload
    # The one schema both ends use: what the API sends, a worker parses back unchanged.
    assert JobDescription.from_json(json.loads(json.dumps(described.to_json()))) == described
    # The congestion target is the appliance's advice; an older appliance's answer has none,
    # and its workers keep fixed windows.
    assert described.queue_target_s == parse({}).jobs.queue_target_s == 0.025
    old = {k: v for k, v in described.to_json().items() if k != "queue_target_s"}
    assert JobDescription.from_json(old).queue_target_s == 0.0


def test_bad_job_requests_are_refused() -> None:
    registry = Registry(parse({}))
    with pytest.raises(BadRequest, match="world_size"):
        registry.plan(JobRequest("job", 0), cookie=1, secret="s", now=0.0)
    for name in ("", "x" * 129, "tab\there", "bell\x07", "new\nline", "-leading", "sp ace"):
        with pytest.raises(BadRequest, match="job name"):
            registry.plan(JobRequest(name, 2), cookie=1, secret="s", now=0.0)
    registry.plan(JobRequest("torch-3f2a_run:7@host+x=1.y", 2), cookie=1, secret="s", now=0.0)


def test_the_tree_written_out_loads_back_equal(tmp_path: Path) -> None:
    cfg = load(REFERENCE)
    again = parse(tomllib.loads(to_toml(cfg)), source=cfg.source)
    assert again == cfg
    assert str(again.multicast.groups) == "239.255.0.0/16"
    assert again.api.listen == HostPort("198.18.0.1", 7070)
    assert again.metrics.listen == HostPort("127.0.0.1", 9108)
    assert parse({"metrics": {"listen": ""}}).metrics.listen is None


def test_a_malformed_registration_answer_names_the_field() -> None:
    good = Registry(parse({})).plan(JobRequest("j", 2), cookie=3, secret="s",
                                    now=0.0).describe(parse({}))
    wire = good.to_json()
    with pytest.raises(SchemaError, match="'world_size' should be int"):
        JobDescription.from_json(wire | {"world_size": "2"})
    with pytest.raises(SchemaError, match="missing 'endpoints'"):
        JobDescription.from_json({k: v for k, v in wire.items() if k != "endpoints"})
    with pytest.raises(SchemaError, match=r"endpoints\[0\]: 'port'"):
        JobDescription.from_json(wire | {"endpoints": [{"core": 0, "host": "h", "port": True,
                                                        "slots": 1}]})


def test_mtu_0_takes_the_data_interfaces_and_says_so() -> None:
    cfg = parse({"dataplane": {"address": "127.0.0.1"}})
    # Loopback's MTU is 65536: the segment is what one UDP datagram can carry, in cache lines.
    assert cfg.dataplane.mtu == 65536 and cfg.dataplane.max_payload == 65408
    assert cfg.dataplane.segment_origin == "MTU 65536 of interface lo, which holds 127.0.0.1"
    configured = parse({"dataplane": {"address": "127.0.0.1", "mtu": 9000}}).dataplane
    assert (configured.max_payload, configured.segment_origin) == (8896, "MTU 9000")
    fixed = parse({"dataplane": {"mtu": 9000, "segment_bytes": 4096}}).dataplane
    assert fixed.segment_origin == "dataplane.segment_bytes"
    # The origin is derived: never written to a file, never read from one.
    assert "mtu_from" not in to_toml(cfg) and parse(tomllib.loads(to_toml(cfg))) == replace(
        cfg, dataplane=replace(cfg.dataplane, mtu_from=""))
    with pytest.raises(ConfigError, match=r"dataplane\.mtu_from: unknown key"):
        parse({"dataplane": {"mtu_from": "x"}})
    with pytest.raises(ConfigError, match=r"dataplane\.address 198\.18\.9\.9, and no interface"):
        parse({"dataplane": {"address": "198.18.9.9"}})
