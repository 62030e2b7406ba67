"""kvtier.settings.fill: an integration's settings from the engine's JSON, each key checked
against its field's type, unknown keys named."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtier.settings import fill


@dataclass
class S:
    pages: int = 1
    timeout_s: float = 1.0
    on: bool = True
    name: str = ""


def test_each_key_takes_its_fields_type_and_only_that():
    s = S()
    fill(s, {"pages": 4, "timeout_s": 2, "on": False, "name": "x"}, "cfg")
    assert (s.pages, s.timeout_s, s.on, s.name) == (4, 2.0, False, "x")
    assert isinstance(s.timeout_s, float)
    # A bool is no number, and a number or a string no bool.
    for key, bad in [("pages", True), ("timeout_s", False), ("on", 1), ("on", "false")]:
        with pytest.raises(ValueError, match=f"cfg.{key}: expected a"):
            fill(S(), {key: bad}, "cfg")


def test_unknown_keys_are_named_as_an_error_or_a_warning(caplog):
    with pytest.raises(ValueError, match=r"unknown cfg keys \['colour'\]"):
        fill(S(), {"colour": "red"}, "cfg")
    s = S()
    fill(s, {"colour": "red", "pages": 2}, "cfg", strict=False)
    assert s.pages == 2
    assert "colour" in caplog.text
