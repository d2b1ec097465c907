"""The cases a command line names (dtypes, ops, sizes) are checked where it is parsed: a wrong
one is a usage error naming the choices (exit status 2), before any rack or appliance starts.
The demo once built the rack and started the appliance, then failed with a worker's usage."""

from __future__ import annotations

import pytest

from reduction_appliance.bench import allreduce, sweep
from reduction_appliance.dataplane.dtypes import short_names
from reduction_appliance.deploy.testnet import demo


def test_dtypes_are_taken_by_their_short_or_their_numpy_name() -> None:
    assert short_names("fp32,float16, bf16,float32") == ["fp32", "fp16", "bf16"]
    for bad in ("float64", "fp32,fp8", ""):
        with pytest.raises(ValueError, match=r"choose from fp32, fp16, bf16 \(or float32"):
            short_names(bad)


@pytest.mark.parametrize(("main", "argv", "said"), [
    (demo.main, ["--dtypes", "float64"], "argument --dtypes: unknown dtype 'float64'"),
    (demo.main, ["--sizes", "12x"], "argument --sizes: bad size '12x'"),
    (allreduce.main, ["--ops", "bogus"], "argument --ops: 'bogus': choose from sum, avg"),
    (allreduce.main, ["--dtypes", "int8"], "argument --dtypes: unknown dtype 'int8'"),
    (allreduce.main, ["--sizes", "1Kix"], "argument --sizes: bad size '1Kix'"),
    (sweep.main, ["--dtypes", "fp8"], "argument --dtypes: unknown dtype 'fp8'"),
])
def test_a_wrong_case_is_a_usage_error_naming_the_choices(
        main: object, argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert callable(main)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
