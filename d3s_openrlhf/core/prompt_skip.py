"""Prompt-level down-sampling before generation: skip prompts whose recent groups had no reward variance.

A group whose G rewards are all equal has every advantage 0 and adds nothing to the policy gradient; D3S's
cross-group selection drops it anyway. Such prompts tend to stay that way from one epoch to the next (too easy or
hopeless for the current policy), so their generation is wasted. GRESO (arXiv 2506.02177) predicts them from their
own history and skips them before generation, with a skip probability that adapts and an exploration floor. Our
policy (the design choices are ours):

* **History.** Per prompt (a stable key: prompt text and label, the same in every epoch whatever the shuffle), the
  number of its most recent generated groups in a row whose rewards were all equal, capped at ``window``.
* **Candidates.** A prompt is a candidate for skipping when its last ``window`` groups all had zero variance. A
  prompt never generated, or whose latest group had variance, is always generated.
* **Skip probability.** A candidate is skipped with probability p, one uniform draw per candidate from the step's
  generator (``step_generator(seed, batch)``): reproducible, also after a resume. p starts at ``init_prob`` and,
  after every batch, follows the observed share z of zero-variance groups among the groups generated:

      p <- clip(p + rate * (z - target), 0, max_prob)

  More zero-variance groups than ``target`` means generation is still being wasted: skip more. Fewer means the
  candidates may have become informative (the policy changed): explore more. GRESO steers its exploration rate
  from the zero-variance share in the same way.
* **Floor.** ``max_prob`` < 1: a candidate is generated with probability at least 1 - max_prob at every visit, so a
  prompt that becomes informative again is seen again, and a generated group with variance takes it off the
  candidate list at once.

Skipped prompts do not change their history (they were not generated). The policy is plain Python and torch's
generator; the samples generator of the integration draws prompts through it and reports every generated group.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Dict, Iterable, List

import torch

PROMPT_SKIP_MODES = ("off", "history")


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value  # NaN != NaN


def _require(name: str, ok: bool, requirement: str, value) -> None:
    """Raise ``ValueError("<name> must be <requirement>, got <value>")`` unless ``ok``."""
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


@dataclass
class PromptSkipPolicy:
    """The skip policy's parameters and state (see the module docstring).

    Args:
        window: groups in a row with zero reward variance that make a prompt a candidate (>= 1).
        target: the zero-variance share of generated groups the skip probability steers towards, in [0, 1).
        max_prob: the skip probability's ceiling, in [0, 1): the exploration floor is 1 - max_prob.
        rate: the adaptation step (> 0).
        prob: the current skip probability, in [0, max_prob].
    """

    window: int = 1
    target: float = 0.25
    max_prob: float = 0.9
    rate: float = 0.05
    prob: float = 0.5
    streaks: Dict[str, int] = field(default_factory=dict)  # prompt key -> zero-variance groups in a row, <= window

    def __post_init__(self):
        _require("window", isinstance(self.window, numbers.Integral) and self.window >= 1, "an int >= 1", self.window)
        _require("target", _real(self.target) and 0.0 <= self.target < 1.0, "a number in [0, 1)", self.target)
        # 1 would never generate a skipped prompt again
        _require("max_prob", _real(self.max_prob) and 0.0 <= self.max_prob < 1.0, "a number in [0, 1)", self.max_prob)
        _require("rate", _real(self.rate) and self.rate > 0.0, "a number > 0", self.rate)
        prob_ok = _real(self.prob) and 0.0 <= self.prob <= self.max_prob
        _require("prob", prob_ok, f"a number in [0, {self.max_prob:g}] (max_prob)", self.prob)

    def is_candidate(self, key: str) -> bool:
        """Whether ``key``'s last ``window`` generated groups all had zero reward variance."""
        return self.streaks.get(key, 0) >= self.window

    def skips(self, keys: Iterable[str], generator: torch.Generator) -> List[bool]:
        """For each prompt key in order: skip it now? One uniform draw per candidate, none for the others."""
        decisions = []
        for key in keys:
            candidate = self.is_candidate(key)
            decisions.append(candidate and float(torch.rand((), generator=generator, dtype=torch.float64)) < self.prob)
        return decisions

    def observe(self, key: str, rewards: Iterable[float]) -> bool:
        """Record one generated group of ``key`` (its G rewards); returns whether its rewards were all equal."""
        rewards = [float(reward) for reward in rewards]
        if not rewards:
            raise ValueError(f"an observed group of prompt {key!r} has no rewards")
        zero_variance = max(rewards) == min(rewards)
        self.streaks[key] = min(self.streaks.get(key, 0) + 1, self.window) if zero_variance else 0
        return zero_variance

    def adapt(self, zero_variance_share: float) -> float:
        """Move the skip probability by ``rate * (share - target)`` within [0, max_prob]; returns the new value."""
        if not 0.0 <= zero_variance_share <= 1.0:
            raise ValueError(f"zero_variance_share must be in [0, 1], got {zero_variance_share!r}")
        self.prob = min(max(self.prob + self.rate * (zero_variance_share - self.target), 0.0), self.max_prob)
        return self.prob

    def state_dict(self) -> Dict:
        """What a checkpoint keeps: the skip probability and every prompt's history."""
        return {"prob": self.prob, "streaks": dict(self.streaks)}

    def load_state_dict(self, state: Dict) -> None:
        self.prob = min(max(float(state["prob"]), 0.0), self.max_prob)
        self.streaks = {key: min(int(streak), self.window) for key, streak in state["streaks"].items()}
