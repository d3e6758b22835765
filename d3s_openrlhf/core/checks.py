"""Type checks shared by the core's validation: Python's bool is an int, which no option here accepts as a number."""

from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integral number that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number that is neither a bool nor NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
