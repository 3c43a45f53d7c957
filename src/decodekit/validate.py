"""Argument checks shared by every layer (STYLE.md 6): TypeError for a wrong type,
ValueError for a bad value, each message naming the argument, what is allowed and what
it got. Imports nothing from decodekit."""

from __future__ import annotations

import math
import numbers


def check_int(name: str, value, low: int, high: float = math.inf) -> int:
    """`value` as a Python int in [low, high] (numpy integers accepted, bools not)."""
    allowed = f"an integer >= {low}" + ("" if high == math.inf else f" and <= {high}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def check_n(n, name: str = "n") -> int:
    """A count: an int >= 1."""
    return check_int(name, n, 1)


def check_range(name: str, value, low: float, high: float = math.inf,
                low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a float in the interval from low to high (open ends excluded); no NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        high_text = "inf" if high == math.inf else f"{high:g}"
        raise ValueError(f"{name} must be in {left}{low:g}, {high_text}{right}, got {value!r}")
    return float(value)
