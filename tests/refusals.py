"""A command-line program refusing bad arguments: argparse's usage error, exit status 2."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest


def refusal(program: Callable[[list[str]], object], argv: Sequence[str],
            capsys: pytest.CaptureFixture[str]) -> str:
    """Run `program(argv)`, which must exit with status 2, and return what it wrote to stderr
    (the reason a user reads)."""
    with pytest.raises(SystemExit) as exc:
        program(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err
