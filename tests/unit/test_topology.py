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
