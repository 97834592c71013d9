"""argparse ``type=`` converters the command lines share: a bad value is argparse's usage error
(exit 2, the option named), never a traceback later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer >= ``minimum`` (and <= ``maximum`` when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value
    return parse


def number(minimum: float, *, strict: bool = False) -> Callable[[str], float]:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if strict else '>='} {minimum:g}, got {text}")
        return value
    return parse
