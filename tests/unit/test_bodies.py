"""The API's request bodies (control/bodies.py): a field that is wrong is a 400 naming it."""

from __future__ import annotations

import pytest

from reduction_appliance.control import bodies
from reduction_appliance.dataplane.errors import BadRequest


def test_words_for_people_keep_to_one_printable_line() -> None:
    """A rank's reason for aborting its job reaches every peer's error and the logs: a
    newline or an escape sequence in it could forge lines there."""
    said = bodies.text({"reason": "path narrow\n2026-12-06 INFO forged\x1b[2J"}, "reason")
    assert said == "path narrow 2026-12-06 INFO forged [2J"
    for wrong in ({}, {"reason": ""}, {"reason": 7}, {"reason": "x" * 257}):
        with pytest.raises(BadRequest, match=r"reason must be a string of 1\.\.256 characters"):
            bodies.text(wrong, "reason")
