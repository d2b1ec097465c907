"""bench.hotpath_ab: two trees' data-path Python, measured in interleaved pairs."""

from __future__ import annotations

from pathlib import Path

import pytest

import reduction_appliance
from reduction_appliance.bench import hotpath_ab
from tests.refusals import refusal

_ROOT = Path(reduction_appliance.__file__).resolve().parent.parent


def test_the_summary_reads_the_pairs_ratios() -> None:
    result = hotpath_ab.Comparison(ours=[9.0, 12.0, 20.0, 8.0], theirs=[10.0, 10.0, 25.0, 10.0])
    assert result.ratios == [0.9, 1.2, 0.8, 0.8]
    text = result.summary("worker", Path("/tmp/base"))
    assert "worker, 4 pairs: this tree min 8.00, median 10.50 us per segment; /tmp/base min " \
           "10.00, median 10.00" in text, text
    assert "paired: median 0.850 (quartiles 0.800-1.125, range 0.800-1.200)" in text, text
    one = hotpath_ab.Comparison(ours=[3.0], theirs=[2.0]).summary("appliance", Path("x"))
    assert "1 pairs" in one and "median 1.500 (quartiles 1.500-1.500" in one, one


def test_a_folder_without_the_package_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no reduction_appliance package"):
        hotpath_ab.tree_of(tmp_path)
    assert hotpath_ab.tree_of(_ROOT) == _ROOT


@pytest.mark.parametrize("argv, reason", [
    (["--pairs", "0", str(_ROOT)], "--pairs must be at least 1"),
    (["/nonexistent/tree"], "holds no reduction_appliance package"),
])
def test_main_refuses_bad_arguments(argv: list[str], reason: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert reason in refusal(hotpath_ab.main, argv, capsys)


def test_a_tree_against_itself_measures_every_pair(capsys: pytest.CaptureFixture[str]) -> None:
    assert hotpath_ab.main([str(_ROOT), "--pairs", "2", "--side", "appliance"]) == 0
    out = capsys.readouterr().out
    assert "appliance, 2 pairs: this tree min" in out and "us per datagram" in out, out
    assert "paired: median" in out, out


def test_a_tree_whose_hotpath_cannot_run_is_named(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "reduction_appliance").mkdir()
    (tmp_path / "reduction_appliance" / "__init__.py").write_text("")  # no bench.hotpath
    assert hotpath_ab.main([str(tmp_path), "--pairs", "1"]) == 1
    # It fails to import, or (an installed tree found instead) imports another tree's: either
    # way it is refused by name, never measured as if it were that tree.
    err = capsys.readouterr().err
    assert err.startswith(f"hotpath_ab: the measuring process of {tmp_path.resolve()} "), err
