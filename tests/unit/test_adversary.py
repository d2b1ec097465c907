"""A host on the data network that may send anything, against the aggregators and the worker
sessions in memory: every delivered result equals the reference, or the round fails with an
error. Never a wrong sum.

The adversary of the threat model (README, "Threat model"): it sees every datagram (so it knows
job ids, cookies, rounds, slot uses), sends any header and payload from its own address, and may
forge the source address of a member (a worker or an appliance core) but then cannot know the
cookie. An attacker that both forges a member's address and reads the cookie is what IPsec or
MACsec on the data network are for.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.transport import Address, MemoryNetwork
from reduction_appliance.dataplane.wire import HEADER, MAGIC, VERSION, DType, Kind, Op
from reduction_appliance.deploy.testnet.reference import integer_valued, reference, same_bits
from reduction_appliance.plugin.rtt import Timing

from .simnet import MULTICAST, Faults, SimNet

KERNELS = select_kernels("numpy")
ATTACKER = ("198.18.0.66", 6666)
COOKIE = 0xC0FFEE  # the simnet job's, as sniffed from any result


class Adversary:
    """Sniffs every datagram and injects, `rate` per simulated millisecond (per millisecond, not
    per step of the clock: steps get shorter the more datagrams are in flight):

    * variations of live traffic: a sniffed contribution replayed with another payload, or
      turned into the RESULT its worker is waiting for (wrong payload), or into a notice
      (RESYNC, DIVERGED, ABORTED, PENDING) for that worker;
    * anything else: random kinds and fields, the cookie or not.

    From its own address it uses the sniffed cookie; forging a member's address, it cannot.
    An opening burst of 4 datagrams at every core makes even a round over in microseconds
    meet it."""

    def __init__(self, seed: int, rate: int, world: int, cores: int) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.members: list[Address] = [("worker", r) for r in range(world)]
        self.members += [("appliance", c) for c in range(cores)]
        self.sniffed: list[tuple[Address, Address, bytes]] = []
        self.sent_until = 0.0
        self.opening: list[Address] = [("appliance", c) for c in range(cores) for _ in range(4)]

    def tap(self, source: Address, dest: Address, datagram: bytes) -> None:
        if source != ATTACKER and source in self.members and len(self.sniffed) < 4096:
            self.sniffed.append((source, dest, datagram))

    def _pick(self, choices: list[int], top: int) -> int:
        rng = self.rng
        return rng.choice(choices) if rng.random() < 0.8 else rng.randrange(top)

    def _credentials(self) -> tuple[Address, bool]:
        """(source, may use the real cookie)"""
        if self.rng.random() < 0.5:
            return self.rng.choice(self.members), False
        return ATTACKER, True

    def _variation(self) -> tuple[Address, Address, bytes]:
        rng = self.rng
        source_was, dest_was, datagram = rng.choice(self.sniffed)
        fields = list(HEADER.unpack_from(datagram))
        source, honest = self._credentials()
        if not honest:
            fields[9] ^= 1 + rng.randrange(2**63)  # the cookie it cannot know
        payload = rng.randbytes(len(datagram) - HEADER.size)
        if fields[2] == Kind.CONTRIBUTION and rng.random() < 0.7:
            # What the worker waits for: the result of that segment, or a notice, forged.
            fields[2] = rng.choice([Kind.RESULT] * 4 + [Kind.RESYNC, Kind.DIVERGED,
                                                      Kind.ABORTED, Kind.PENDING])
            if fields[2] is Kind.RESYNC:
                fields[8] = (fields[8] + 1) % 2**16
            return source, source_was, HEADER.pack(*fields) + payload
        return source, dest_was, HEADER.pack(*fields) + payload

    def _random(self) -> tuple[Address, Address, bytes]:
        rng = self.rng
        source, honest = self._credentials()
        cookie = self._pick([COOKIE], 2**64) if honest else rng.randrange(2**64)
        payload = rng.randbytes(rng.choice([0, 4, 16, 64, 256, rng.randrange(300)]))
        header = HEADER.pack(
            MAGIC, VERSION, rng.choice(list(Kind)), rng.choice(list(DType)),
            rng.choice(list(Op)), rng.randrange(256), self._pick([7], 2**32),
            self._pick(list(range(len(self.members))), 2**16), self._pick([1, 2], 2**16),
            cookie, self._pick([1, 2, 3, 2**32 - 1], 2**32), self._pick(list(range(4)), 2**32),
            self._pick([0, 256, 512], 2**64), self._pick([len(payload)], 2**32),
            self._pick([1, 2, 3], 2**32))
        return source, rng.choice([*self.members, MULTICAST]), header + payload

    def __call__(self, net: MemoryNetwork) -> None:
        due = int((net.now - self.sent_until) * 1000 * self.rate)
        if due:
            self.sent_until += due / (1000 * self.rate)
        forged = [(s, core, d) for core in self.opening for s, _, d in [self._random()]]
        self.opening.clear()
        for _ in range(due):
            use_sniffed = self.sniffed and self.rng.random() < 0.7
            forged.append(self._variation() if use_sniffed else self._random())
        for source, dest, datagram in forged:
            net.transmit(source, dest, datagram)


@pytest.mark.slow  # 120 simulated attacks: seconds
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(1, 4),
    cores=st.integers(1, 2),
    elements=st.integers(1, 1500),
    drop=st.sampled_from([0.0, 0.1]),
    rate=st.sampled_from([1, 20, 200]),
    deterministic=st.booleans(),
    multicast=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_an_adversary_never_changes_a_delivered_sum(
    world: int, cores: int, elements: int, drop: float, rate: int, deterministic: bool,
    multicast: bool, seed: int,
) -> None:
    attacker = Adversary(seed, rate, world, cores)
    net = SimNet(KERNELS, world=world, cores=cores, slots=3, deterministic=deterministic,
                 multicast=multicast, faults=Faults(drop, 0.0, 0.002, seed),
                 timing=Timing(0.01, 0.002, 0.2, 5.0), adversary=attacker, tap=attacker.tap)
    rng = np.random.default_rng(seed)
    try:
        for op in (Op.SUM, Op.MAX):
            xs = [integer_valued(rng, elements, DType.FLOAT32) for _ in range(world)]
            want = reference(xs, op)
            arrays = [x.copy() for x in xs]
            rounds = net.allreduce(arrays, DType.FLOAT32, op)
            for rnd, a in zip(rounds, arrays, strict=True):
                assert rnd.done and same_bits(a, want)
        net.drain()  # a round over in microseconds ends before the opening burst arrives
        counters = [agg.counters.snapshot() for agg in net.aggregators]
        assert sum(c["drop_bad_source"] + c["drop_bad_cookie"] + c["drop_malformed"]
                   + c["drop_unknown_job"] + c["drop_bad_rank"] for c in counters) > 0
        assert all(c["drop_mismatch"] == 0 for c in counters)  # nobody made them diverge
    finally:
        net.close()
