"""deploy.testnet.topology: a rack refused in the words of `reductionctl lab up`'s user (the
refusals once named `rack()` and its `name_prefix` parameter). Pure: no namespace is made."""

from __future__ import annotations

import pytest

from reduction_appliance.deploy.testnet.topology import RACK_WORKERS_MAX, Topology


@pytest.mark.parametrize(("workers", "appliances"), [(0, 1), (RACK_WORKERS_MAX + 1, 1), (3, 0)])
def test_a_rack_out_of_its_subnet_says_what_it_holds(workers: int, appliances: int) -> None:
    with pytest.raises(ValueError) as refused:
        Topology.rack(workers, appliances)
    assert str(refused.value) == (f"a rack holds 1..100 appliances and 1..{RACK_WORKERS_MAX} "
                                  f"workers (one /24), not {appliances} and {workers}")


def test_a_lab_name_is_refused_saying_what_fits() -> None:
    with pytest.raises(ValueError, match=r"lab name 'a/b': a lowercase letter, then lowercase "):
        Topology.rack(1, prefix="a/b")
    with pytest.raises(ValueError, match=r"lab name 'x{20}' is too long: with host 'a0' its "
                                         r"interface names pass 15 characters \(at most 12 "):
        Topology.rack(1, prefix="x" * 20)
    assert Topology.rack(1, prefix="x" * 12).name_prefix == "x" * 12


def test_one_bad_cable_impairs_its_workers_link_alone() -> None:
    rack = Topology.rack(4, rate="1gbit", loss_pct=5.0, duplicate_pct=1.0, reorder_pct=2.0,
                         impaired=[3])
    bad = rack.link_of("w3")
    assert (bad.loss_pct, bad.duplicate_pct, bad.reorder_pct) == (5.0, 1.0, 2.0)
    for name in ("w0", "w1", "w2"):
        clean = rack.link_of(name)
        assert (clean.loss_pct, clean.duplicate_pct, clean.reorder_pct) == (0.0, 0.0, 0.0)
        assert (clean.rate, clean.mtu) == (bad.rate, bad.mtu)  # a clean cable, not a slower one
    assert rack.link_of("a0").loss_pct == 0.0
    everyone = Topology.rack(4, loss_pct=5.0)  # the default: every worker's cable
    assert all(everyone.link_of(f"w{i}").loss_pct == 5.0 for i in range(4))


@pytest.mark.parametrize("impaired", [[4], [-1]])
def test_an_impaired_worker_outside_the_rack_is_refused(impaired: list[int]) -> None:
    with pytest.raises(ValueError, match=rf"impaired worker {impaired[0]} is not in the rack's "
                                         r"0\.\.3"):
        Topology.rack(4, loss_pct=5.0, impaired=impaired)


def test_a_rack_of_ranks_on_shared_hosts_must_fill_every_host() -> None:
    from reduction_appliance.deploy.testnet.harness import LabNetwork

    with pytest.raises(ValueError, match="5 ranks do not fill hosts of 2"), \
            LabNetwork.rack(5, ranks_per_host=2):
        pass
