"""The dynamic (N, K) down-sampling schedule of D3S (arXiv 2509.22115).

    [N(p), K(p)] = (1 - p) * [N_init, K_init] + p * [N_final, K_final],   p = min(step / (S - 1), 1)

over a run of S = ``total_steps`` steps, numbered 0 .. S - 1: the first step trains the init point (p = 0) and the
last one the final point (p = 1), so both ends of the paper's schedule are trained; steps past S - 1 (a run longer
than its schedule) keep the final point. A single step (S = 1) is the final point: it is the run's last step, and
"the last step trains (N_final, K_final)" holds for every S, as "steps from S - 1 on are final" does.

``kind="linear"`` uses p as is; ``kind="cosine"`` eases in and out with p' = (1 - cos(pi * p)) / 2, computed as
the equal sin(pi * p / 2) ** 2, which is exact at both ends and monotone; ``kind="constant"`` returns the init
values at every step (``n_final`` and ``k_final`` are then not used).

The schedule is a pure function of the step and S, so a run resumed at step s (with the S it started with)
continues with exactly the values it would have had.

Rounding of N (our choice; the paper is silent): N(p) is rounded to the nearest integer with halves rounded up
(8.5 -> 9). For ``linear`` the interpolation is done in exact rational arithmetic, so a mathematically exact half
is always recognised; for ``cosine`` the value is a float and anything within 1e-9 below a half counts as the
half. K is interpolated as K_init + p * (K_final - K_init) (the same quantity as the paper's form) and clamped to
[min(K_init, K_final), max(K_init, K_final)], which makes it monotone in the step even in floating point and
exactly K_init / K_final at the two ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Tuple, Union

from d3s_openrlhf.core.checks import is_real, require_int

SCHEDULE_KINDS = ("linear", "cosine", "constant")

# Slack for recognising a half in float interpolation (cosine); float error there is ~1e-13 for any N we meet.
_HALF_SLACK = 1e-9


def _require_fraction(name: str, value) -> float:
    if not is_real(value):
        raise ValueError(f"{name} must be a real number in (0, 1], got {value!r}")
    value = float(value)
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def _round_half_up(value: Union[Fraction, float]) -> int:
    if isinstance(value, Fraction):
        return math.floor(value + Fraction(1, 2))
    return math.floor(value + 0.5 + _HALF_SLACK)


@dataclass(frozen=True)
class DownSamplingSchedule:
    """(N, K) as a function of the training step; see the module docstring for the exact rules.

    Args:
        n_init, n_final: rollouts kept per prompt at p = 0 and p = 1 (D3S N_init, N_final), ints >= 1. Either
            order is accepted (an increasing N is the paper's curriculum).
        k_init, k_final: fraction of tokens kept at p = 0 and p = 1 (D3S K_init, K_final), in (0, 1].
        total_steps: S, the steps 0 .. S - 1 over which p goes from 0 to 1 (int >= 1); later steps use p = 1.
        kind: "linear", "cosine" or "constant".
    """

    n_init: int
    n_final: int
    k_init: float
    k_final: float
    total_steps: int
    kind: str = "linear"

    def __post_init__(self):
        object.__setattr__(self, "n_init", require_int("n_init", self.n_init, 1))
        object.__setattr__(self, "n_final", require_int("n_final", self.n_final, 1))
        object.__setattr__(self, "k_init", _require_fraction("k_init", self.k_init))
        object.__setattr__(self, "k_final", _require_fraction("k_final", self.k_final))
        object.__setattr__(self, "total_steps", require_int("total_steps", self.total_steps, 1))
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(SCHEDULE_KINDS)}, got {self.kind!r}")

    @property
    def last_step(self) -> int:
        """S - 1: the step at which p reaches 1 (0-based, the run's last step when it trains S steps)."""
        return self.total_steps - 1

    def progress(self, step: int) -> float:
        """p = min(step / (S - 1), 1) for a step >= 0 (before the cosine easing); 1 at every step when S = 1."""
        step = require_int("step", step, 0)
        return 1.0 if step >= self.last_step else step / self.last_step

    def at(self, step: int) -> Tuple[int, float]:
        """(N, K) at ``step`` (0-based; steps from S - 1 on give the final values)."""
        step = require_int("step", step, 0)
        if self.kind == "constant":
            return self.n_init, self.k_init
        if step >= self.last_step:
            return self.n_final, self.k_final
        if self.kind == "linear":
            exact_p = Fraction(step, self.last_step)
            n = _round_half_up(self.n_init + exact_p * (self.n_final - self.n_init))
            p = step / self.last_step
        else:  # cosine
            p = math.sin(math.pi * step / (2 * self.last_step)) ** 2
            n = _round_half_up(self.n_init + p * (self.n_final - self.n_init))
        k = self.k_init + p * (self.k_final - self.k_init)
        k = min(max(k, min(self.k_init, self.k_final)), max(self.k_init, self.k_final))
        return n, k

    @property
    def moves(self) -> bool:
        """Whether (N, K) change over the run (a constant schedule, or equal ends, does not)."""
        if self.kind == "constant":
            return False
        return self.n_init != self.n_final or self.k_init != self.k_final

    @property
    def n_values(self) -> range:
        """Every N the schedule can return, whatever ``total_steps`` (N moves monotonically from init to final)."""
        if self.kind == "constant":
            return range(self.n_init, self.n_init + 1)
        return range(min(self.n_init, self.n_final), max(self.n_init, self.n_final) + 1)

    @property
    def max_n(self) -> int:
        """The largest N the schedule ever returns (the group size G must be at least this)."""
        return self.n_values[-1]

    @property
    def min_k(self) -> float:
        """The smallest K the schedule ever returns (token selection is active iff this is < 1)."""
        if self.kind == "constant":
            return self.k_init
        return min(self.k_init, self.k_final)
