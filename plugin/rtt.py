"""Retransmission timing of a worker's rounds: the bounds (`Timing`) and one smoothed round-trip
estimate per appliance core (`RttEstimator`, RFC 6298 with Karn's rule applied by its caller),
carried from round to round by the client. Sans-I/O: times are passed in."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["RELIABLE_RTO_S", "RttEstimator", "Timing"]

RELIABLE_RTO_S = 1.0  # first retransmission timeout over a reliable transport (RoCE)


@dataclass(frozen=True)
class Timing:
    rto_initial: float = 0.05  # before the first sample of a core
    rto_min: float = 0.01  # the floor: a rack's round trips are well under it
    rto_max: float = 1.0  # one segment's backed-off timer never waits longer
    deadline: float = 60.0  # a round that gets no result for this long fails (plugin.session)
    # ... nor longer than this per segment in flight to its core: a silent core's last few
    # segments are asked after this often, since over datagrams a lost answer is likelier than
    # a dead core (plugin.session's `due`)
    silent_query_gap: float = 0.025

    def reliable(self) -> Timing:
        """The timing over a reliable transport (RoCE's RC). It loses nothing in transit: a
        timer only repairs what the appliance dropped on purpose (a full queue), so it starts
        long and never fires at a large segment that is merely slow to serialise; samples
        still bring it down to the path's RTT. A silent core is busy, not unlucky: its timers
        back off all the way."""
        rto_max = max(self.rto_max, 5 * RELIABLE_RTO_S)
        return replace(self, rto_initial=max(self.rto_initial, RELIABLE_RTO_S),
                       rto_min=max(self.rto_min, RELIABLE_RTO_S / 5), rto_max=rto_max,
                       silent_query_gap=rto_max)


@dataclass
class RttEstimator:
    """Smoothed round-trip time per destination (RFC 6298), carried from round to round.
    Destinations are endpoint indices (appliance cores); each has its own estimate."""

    timing: Timing = field(default_factory=Timing)
    _srtt: dict[int, float] = field(default_factory=dict)
    _rttvar: dict[int, float] = field(default_factory=dict)
    # Each destination's RTO, worked out when first asked after a sample: a worker asks
    # every turn (plugin/session.py's `due`), about once per ten samples on a fast link.
    _rto: dict[int, float] = field(default_factory=dict)
    _rto_timing: Timing | None = None  # the bounds `_rto` was worked out with

    def sample(self, dest: int, rtt: float, per_rtt: int = 1) -> None:
        """One round trip to `dest`. `per_rtt`: how many samples a round trip brings (the
        segments in flight to it). RFC 6298's gains assume one; with a window of them, the
        unscaled gains would forget within a fraction of a round trip, and since neighbouring
        segments' round trips are alike, RTTVAR collapses to the last few segments' spread
        and the timer fires inside the ordinary spread (RFC 7323, appendix G: divide the gains
        by the samples per round trip)."""
        self._rto.pop(dest, None)
        srtt = self._srtt.get(dest)
        if srtt is None:
            self._srtt[dest], self._rttvar[dest] = rtt, rtt / 2
        else:
            scale = 1.0 / per_rtt if per_rtt > 1 else 1.0
            rttvar = self._rttvar[dest]
            self._rttvar[dest] = rttvar + 0.25 * scale * (abs(srtt - rtt) - rttvar)
            self._srtt[dest] = srtt + 0.125 * scale * (rtt - srtt)

    def srtt(self, dest: int) -> float | None:
        return self._srtt.get(dest)

    def rto(self, dest: int) -> float:
        t = self.timing
        if t is not self._rto_timing:  # new bounds (a caller may swap `timing`)
            self._rto.clear()
            self._rto_timing = t
        rto = self._rto.get(dest)
        if rto is None:
            srtt = self._srtt.get(dest)
            base = t.rto_initial if srtt is None else srtt + 4 * self._rttvar[dest]
            self._rto[dest] = rto = min(t.rto_max, max(t.rto_min, base))
        return rto
