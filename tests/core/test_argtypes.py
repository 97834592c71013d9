"""The shared argparse converters: bounds, strictness, non-finite and non-numeric text."""

from __future__ import annotations

import argparse

import pytest

from polyaccel.core.argtypes import integer, number


def test_integer_bounds() -> None:
    assert integer(1)("3") == 3 and integer(0)("0") == 0
    for text, message in (("0", "must be >= 1, got 0"), ("1.5", "expected an integer"), ("x", "expected an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            integer(1)(text)
    assert integer(1, 256)("256") == 256
    with pytest.raises(argparse.ArgumentTypeError, match="must be <= 256, got 257"):
        integer(1, 256)("257")


def test_number_bounds_and_strictness() -> None:
    assert number(0)("0") == 0.0 and number(0, strict=True)("0.5") == 0.5
    for parse, text, message in ((number(0, strict=True), "0", "must be a number > 0, got 0"),
                                 (number(0), "-1", "must be a number >= 0, got -1"),
                                 (number(0), "nan", ">= 0, got nan"), (number(0), "inf", ">= 0, got inf"),
                                 (number(0), "two", "expected a number")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)
