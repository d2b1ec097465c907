"""bench.loss's arithmetic and arguments, in memory (its runs need the emulated rack)."""

from __future__ import annotations

import pytest

from reduction_appliance.bench import loss

MIB = 1 << 20


@pytest.mark.parametrize("size, least, expected", [
    (MIB, 3, 16),  # 16 MiB of timed calls: 13x the 1 Gbit/s shaper's bucket
    (2 * MIB, 3, 8),
    (3 * MIB, 3, 6),  # rounded up: at least TIMED_BYTES
    (64 * MIB, 3, 3),  # big enough already: --iters rules
    (MIB, 20, 20),
])
def test_small_sizes_get_enough_timed_calls_to_move_timed_bytes(
        size: int, least: int, expected: int) -> None:
    assert loss.iterations_for(size, least) == expected
    assert loss.iterations_for(size, least) * size >= min(loss.TIMED_BYTES, least * size)


def test_the_report_passes_a_target_only_when_the_median_repeat_meets_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    times = {(0.0, MIB): [0.010, 0.010, 0.012], (5.0, MIB): [0.080, 0.095, 0.150]}
    retx = {key: [0.1] for key in times}
    assert loss.report([0.0, 5.0], [MIB], times, retx)  # 0.010 / 0.095: 11% >= 10%
    assert "PASS >= 10% (worst repeat 7%)" in capsys.readouterr().out
    times[(5.0, MIB)] = [0.080, 0.105, 0.150]
    assert not loss.report([0.0, 5.0], [MIB], times, retx)  # 0.010 / 0.105: 10%, just under
    assert "FAIL >= 10%" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--repeat", "0"],
                                  ["--queue-target", "-1"]])
def test_bad_arguments_are_refused_with_the_reason(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        loss.main(argv)
    assert exc.value.code == 2
    assert "at least 1" in capsys.readouterr().err or "--queue-target" in argv
