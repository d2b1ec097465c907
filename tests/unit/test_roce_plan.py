"""RoCE as the control plane plans it, without any RDMA device: the [roce] section, jobs that
ask for RoCE, the address space of RoCE peers, and a core's two transports behind one seam."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from typing import Any

import pytest

from reduction_appliance.control.bodies import check_landings, parse_request
from reduction_appliance.control.config import parse, to_toml
from reduction_appliance.control.registry import JobRequest, Registry
from reduction_appliance.dataplane.dual import DualCoreTransport
from reduction_appliance.dataplane.errors import BadRequest, ConfigError
from reduction_appliance.dataplane.registration import JobDescription
from reduction_appliance.dataplane.roce import ROCE_GROUP_PORT, ROCE_PORTS, RoceCoreTransport
from reduction_appliance.dataplane.slots import RxPool
from reduction_appliance.dataplane.transport import RxBatch, Send, TransportCounts
from reduction_appliance.dataplane.verbs import (
    SEND_BYTES,
    ChunkTag,
    Landing,
    QpEndpoint,
    multicast_gid,
)
from reduction_appliance.dataplane.wire import HEADER_SIZE, DType, Header, Kind, Op, pack_into

ROCE = {"device": "rxe1", "segment_bytes": 262144}


def test_roce_is_off_by_default_and_on_with_a_device() -> None:
    assert not parse({}).roce.enabled
    cfg = parse({"roce": ROCE, "dataplane": {"slot_memory_mb": 64}})
    assert cfg.roce.enabled and cfg.arena_payload == 262144
    # Every slot of the arena holds the largest segment: the budget buys fewer slot pairs.
    assert cfg.slot_capacity == 64 * 2**20 // (6 * 262144) < cfg.dataplane.slot_capacity
    assert parse(tomllib.loads(to_toml(cfg))).roce == cfg.roce


@pytest.mark.parametrize(("roce", "names"), [
    ({"segment_bytes": 1000}, "roce.segment_bytes"),
    ({"segment_bytes": 32 << 20}, "roce.segment_bytes"),
    ({"send_depth": 8}, "roce.send_depth"),
    ({"queue_pairs": 5000}, "roce.queue_pairs"),
    ({"gid_index": -1}, "roce.gid_index"),
    ({"devcie": "rxe1"}, "roce.devcie: unknown key"),
])
def test_bad_roce_settings_name_the_key(roce: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        parse({"roce": roce})


def test_a_slot_budget_too_small_for_roce_segments_is_refused() -> None:
    with pytest.raises(ConfigError, match="slot_memory_mb"):
        parse({"roce": {**ROCE, "segment_bytes": 16 << 20}, "dataplane": {"slot_memory_mb": 64}})
    with pytest.raises(ConfigError, match=r"jobs\.slots"):
        parse({"roce": ROCE, "dataplane": {"slot_memory_mb": 8}, "jobs": {"slots": 32}})


def test_a_roce_job_needs_an_appliance_with_roce_and_has_no_multicast() -> None:
    udp_only = Registry(parse({}))
    with pytest.raises(BadRequest, match=r"no RDMA device \(config \[roce\] device\)"):
        udp_only.plan(JobRequest("r", 2, transport="roce"), cookie=1, secret="s", now=0.0)
    with pytest.raises(BadRequest, match="transport must be udp or roce"):
        udp_only.plan(JobRequest("r", 2, transport="ib"), cookie=1, secret="s", now=0.0)
    cfg = parse({"roce": ROCE, "dataplane": {"slot_memory_mb": 64}, "jobs": {"slots": 8}})
    reg = Registry(cfg)
    roce = reg.plan(JobRequest("r", 2, transport="roce"), cookie=1, secret="s", now=0.0)
    udp = reg.plan(JobRequest("u", 2), cookie=2, secret="s", now=0.0)
    assert roce.spec.multicast is None and udp.spec.multicast is not None
    told = roce.describe(cfg)
    assert told.transport == "roce" and told.segment_bytes == 262144
    assert udp.describe(cfg).segment_bytes == cfg.dataplane.max_payload
    # The answer a worker parses carries the transport (an older appliance's answer: udp).
    assert JobDescription.from_json(told.to_json()).transport == "roce"
    old = {k: v for k, v in told.to_json().items() if k != "transport"}
    assert JobDescription.from_json(old).transport == "udp"


def test_queue_pair_endpoints_travel_as_json_and_bad_ones_are_named() -> None:
    end = QpEndpoint("rxe1", "0000:0000:0000:0000:0000:ffff:0a4d:0001", 17, 0xABCDE, 4096)
    assert QpEndpoint.from_json(end.as_json()) == end
    with pytest.raises(ValueError, match="not a queue-pair endpoint"):
        QpEndpoint.from_json({"device": "rxe1", "gid": "x", "qpn": "many"})


def test_a_workers_end_names_its_landing_and_a_bad_landing_is_named() -> None:
    gid = "0000:0000:0000:0000:0000:ffff:0a4d:0002"
    end = QpEndpoint("rxe2", gid, 18, 7, 4096, Landing(0x7F0000000000, 0x1234, 32, 262208))
    assert end.as_json()["landing"] == {"address": 0x7F0000000000, "rkey": 0x1234,
                                        "slots": 32, "stride": 262208}
    assert QpEndpoint.from_json(end.as_json()) == end
    for bad in ({"slots": 0}, {"stride": 8}, {"rkey": "none"}, {"address": 0}):
        d = end.as_json()
        d["landing"] = {**end.landing.as_json(), **bad}  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="not a queue-pair endpoint"):
            QpEndpoint.from_json(d)


def test_the_control_plane_refuses_a_landing_that_cannot_take_every_slot() -> None:
    gid = "0000:0000:0000:0000:0000:ffff:0a4d:0002"
    need = HEADER_SIZE + 262144

    def end(slots: int, stride: int) -> dict[str, Any]:
        return QpEndpoint("rxe2", gid, 18, 7, 4096, Landing(4096, 1, slots, stride)).as_json()

    check_landings([end(32, need), end(40, need + 64)], 32, need)
    with pytest.raises(BadRequest, match=r"queue_pairs\[0\] names no landing"):
        check_landings([QpEndpoint("rxe2", gid, 19, 7, 4096).as_json()], 32, need)
    with pytest.raises(BadRequest, match=r"queue_pairs\[1\]: the landing holds 16 entries"):
        check_landings([end(32, need), end(16, need)], 32, need)
    with pytest.raises(BadRequest, match="the job needs 32 of 262192"):
        check_landings([end(32, need - 64)], 32, need)
    with pytest.raises(BadRequest, match="not a queue-pair endpoint"):
        check_landings([{"device": "rxe2"}], 32, need)


def _header(kind: Kind, slot: int, length: int) -> bytearray:
    buf = bytearray(HEADER_SIZE)
    pack_into(buf, Header(kind, DType.FLOAT32, Op.SUM, 0, 7, 1, 1, 99, slot, 0, length, 1))
    return buf


def test_only_a_result_for_a_landing_slot_is_written_there() -> None:
    landing = Landing(1 << 20, 5, 8, HEADER_SIZE + 65536)
    where = RoceCoreTransport._landing_slot
    assert where(landing, _header(Kind.RESULT, 3, 65536), HEADER_SIZE + 65536) == 3
    assert where(landing, _header(Kind.RESULT, 7, 8192), HEADER_SIZE + 8192) == 7
    assert where(landing, _header(Kind.RESULT, 8, 8192), HEADER_SIZE + 8192) == -1  # no slot 8
    assert where(landing, _header(Kind.RESULT, 3, 65600), HEADER_SIZE + 65600) == -1  # too big
    # Anything else that large has no landing entry (and no worker receive buffer takes it).
    assert where(landing, _header(Kind.LIVENESS, 3, SEND_BYTES), HEADER_SIZE + SEND_BYTES) == -1
    assert where(None, _header(Kind.RESULT, 3, 8192), HEADER_SIZE + 8192) == -1


def test_roce_peer_ports_never_meet_an_ephemeral_udp_port() -> None:
    assert ROCE_PORTS.start >= 1 and ROCE_PORTS.stop <= 1024
    assert ROCE_GROUP_PORT not in ROCE_PORTS and ROCE_GROUP_PORT < 1024


def test_a_roce_job_multicasts_its_results_only_when_it_asks() -> None:
    cfg = parse({"roce": ROCE, "dataplane": {"slot_memory_mb": 64}, "jobs": {"slots": 8}})
    reg = Registry(cfg)
    # The API settles an absent "multicast" by transport, so every rank asks the same.
    roce, udp = (parse_request({"name": n, "world_size": 2, "transport": t})
                 for n, t in (("r", "roce"), ("u", "udp")))
    assert roce.multicast is False and udp.multicast is True
    asked = parse_request({"name": "m", "world_size": 2, "transport": "roce", "multicast": True})
    plans = [reg.plan(req, cookie=i, secret="s", now=0.0)
             for i, req in enumerate((roce, udp, asked), start=1)]
    assert plans[0].spec.multicast is None
    assert plans[1].spec.multicast is not None
    assert plans[1].spec.multicast[1] == cfg.multicast.port
    group = plans[2].spec.multicast
    assert group is not None and group[1] == ROCE_GROUP_PORT  # the core's RoCE half sends it
    assert plans[2].describe(cfg).multicast == group  # and the workers join it


def test_multicast_chunks_are_named_in_their_immediate() -> None:
    for slot, use, chunk in ((0, 1, 0), (4095, 17, 65535), (31, 2, 256)):
        assert ChunkTag.unpack(ChunkTag.pack(slot, use, chunk)) == (slot, use & 0xF, chunk)
        assert 0 <= ChunkTag.pack(slot, use, chunk) < 2**32
    assert multicast_gid("239.255.77.1") == "0000:0000:0000:0000:0000:ffff:efff:4d01"
    core = QpEndpoint("rxe1", "0000:0000:0000:0000:0000:ffff:0a4d:0001", 17, 5, 4096,
                      multicast_qpn=23)
    assert QpEndpoint.from_json(core.as_json()).multicast_qpn == 23


class FakeHalf:
    """One half of a core's transports: what it would receive, what it was given to send."""

    idle_block_s = 0.001

    def __init__(self, arrivals: list[int],
                 served: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.arrivals = arrivals
        self.served = served
        self.sent: list[Send] = []

    def serves(self, address: tuple[str, int]) -> bool:
        return address in self.served

    def fileno(self) -> int:
        return 3

    def receive(self, pool: RxPool, batch: RxBatch, limit: int) -> int:
        batch.clear()
        for _ in range(min(limit, self.arrivals.pop(0) if self.arrivals else 0)):
            batch.add(0, 48, ("198.18.0.1", 1))
        return batch.count

    def send(self, sends: Sequence[Send]) -> None:
        self.sent.extend(sends)

    def take_counts(self) -> TransportCounts:
        return TransportCounts(len(self.sent), 10 * len(self.sent), 0)

    def fallbacks(self) -> tuple[str, ...]:
        return ()


def test_the_dual_transport_routes_sends_and_takes_turns_receiving() -> None:
    qp, udp_worker = ("198.18.0.2", 1), ("198.18.0.2", 40000)
    roce, udp = FakeHalf([3, 0, 2], frozenset({qp})), FakeHalf([5, 4])
    dual = DualCoreTransport(udp, roce)  # type: ignore[arg-type]
    sends = [Send(qp, b"h", b"a"), Send(udp_worker, b"h", b"b"), Send(qp, b"h", b"c")]
    dual.send(sends)
    assert [s.payload for s in roce.sent] == [b"a", b"c"] and udp.sent == [sends[1]]
    counts = dual.take_counts()
    assert counts.datagrams_sent == 3 and counts.bytes_sent == 30
    batch = RxBatch()
    pool: Any = None
    # RoCE first (3), then UDP first (5), then RoCE (nothing) so UDP at once (4), then RoCE (2).
    assert [dual.receive(pool, batch, 64) for _ in range(4)] == [3, 5, 4, 2]
