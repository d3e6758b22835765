"""What the core's validation shares: type checks (Python's bool is an int, which no option here accepts as a
number), the form of an invalid option (:class:`Problem`, raised together in :class:`InvalidOptions`), whose
parameter and requirement are fields, so that no caller reads them back out of the message, and checks of tensor
contents that never make the host wait for an accelerator (:func:`check_on_device`)."""

from __future__ import annotations

import numbers
from typing import NamedTuple, Sequence

import torch


def is_int(value) -> bool:
    """An integral number that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_int(name: str, value, minimum: int) -> int:
    """``value`` as an int, or ValueError naming ``name`` if it is not an int (bools refused) or below ``minimum``."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def is_real(value) -> bool:
    """A real number that is neither a bool nor NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def check_on_device(condition: torch.Tensor, message: str) -> None:
    """Refuse data whose 0-d bool ``condition`` is False, without making the host wait for the device.

    On a CPU, ValueError(``message``) at once (the value is on the host already). On an accelerator, an asynchronous
    device-side assertion (``torch._assert_async``): reading the value would stall the host at every call, where the
    assertion stops the process at the failing kernel (CUDA reports a device-side assert at the next
    synchronisation; the message overload of ``_assert_async`` is CPU-only in some builds, so the message is the
    CPU's alone). For invariants whose failure is a bug upstream of the check (token ids
    outside the vocabulary, misaligned rows): a run with such data cannot go on, and on an accelerator the kernels
    reading it would assert or read out of bounds anyway."""
    if condition.device.type != "cpu":
        torch._assert_async(condition)
    elif not bool(condition):
        raise ValueError(message)


class Problem(NamedTuple):
    """One invalid option: its ``parameter`` (as the caller names it, e.g. ``--d3s.n_init``), the ``value`` given and
    the ``requirement`` it fails ("must be ..." or what to change), which reads on after ``parameter=value: ``."""

    parameter: str
    value: object
    requirement: str

    def __str__(self) -> str:
        return f"{self.parameter}={self.value!r}: {self.requirement}"


class InvalidOptions(ValueError):
    """Every invalid option of one call at once: as fields (``problems``) and one line each in the message."""

    def __init__(self, heading: str, problems: Sequence[Problem]):
        self.heading, self.problems = heading, tuple(problems)
        super().__init__(f"{heading}:\n  " + "\n  ".join(map(str, self.problems)))

    def __reduce__(self):  # picklable with its fields (Ray sends exceptions between processes)
        return type(self), (self.heading, self.problems)
