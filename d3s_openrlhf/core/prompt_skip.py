"""Prompt-level down-sampling before generation: skip prompts whose own record says their group will be wasted.

A group whose G rewards are all equal has every advantage 0 and adds nothing to the policy gradient; D3S's
cross-group selection drops it anyway. Such prompts tend to stay that way for a while (too easy or hopeless for
the current policy), so generating them again is wasted. GRESO (arXiv 2506.02177) predicts them from each prompt's
own history and skips them before generation. Our policy (the design and its reasons: docs/generation.md):

* **Record.** Per prompt (a stable key), its streak c: how many of its most recent observations in a row had zero
  reward variance. An observation is a generated group: a flat one extends the prompt's streak, one with variance
  resets it to 0.
* **Per-prompt skip probability** (GRESO's streak rule): a prompt with streak c is skipped with probability

      q(c) = 1 - max(base^c, floor)            (q(0) = 0: a prompt never seen, or last seen with variance)

  so one zero-variance observation makes a prompt a candidate and every further one makes it likelier to be
  skipped, up to ``1 - floor``. Each prompt's probability comes from its own record: no global probability that
  a few prompts can push to its ceiling for all.
* **Exploration floor.** ``floor`` >= 0.01: a candidate is generated at least once in 1 / floor visits, so a
  prompt the changing policy has made informative again comes back; its first observation with variance resets
  its streak.
* **Adaptation of the base**, without windup: after a batch in which at least one candidate was drawn, the base
  moves against the share z of zero-variance observations among the prompts generated:

      base <- clip(base - rate * (z - target), BASE_MIN, BASE_MAX)

  More wasted observations than ``target``: a smaller base, so candidates are skipped more. A batch that drew no
  candidate leaves the base alone: skipping could not have changed its share (the first pass over the data, where
  the old global probability fell for nothing).

A skipped prompt is not observed (it costs no rollout) and keeps its streak. A decision compares q(c) with a
uniform draw the caller supplies. The samples generator of the integration, which draws prompts through the policy
and reports every generated group, keys that draw by (seed, batch, prompt, the prompt's occurrence in the batch)
(``core.selection.keyed_uniform``), not by the order of the draws: a prompt drawn in the same batch with the same
history gets the same decision in a run, its rerun and a resumed run. The policy is plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from d3s_openrlhf.core.checks import InvalidOptions, Problem, is_real

PROMPT_SKIP_MODES = ("off", "history")

BASE_MIN, BASE_MAX = 0.05, 0.95  # GRESO's clamp of its base probability
MIN_FLOOR = 0.01  # the exploration floor may not go below 1%: a skipped prompt must come back
MAX_STREAK = 128  # BASE_MAX^128 < MIN_FLOOR: a longer streak changes no probability


def zero_variance(rewards: Iterable[float]) -> bool:
    """Whether a group's rewards are all equal: every group-relative advantage is then 0."""
    rewards = [float(reward) for reward in rewards]
    if not rewards:
        raise ValueError("an observed group has no rewards")
    if not all(reward == reward and abs(reward) != float("inf") for reward in rewards):
        raise ValueError(f"an observed group has a non-finite reward: {rewards}")
    return max(rewards) == min(rewards)


@dataclass
class PromptSkipPolicy:
    """The skip policy's parameters and state (see the module docstring).

    Args:
        base: the streak rule's base in [BASE_MIN, BASE_MAX]: q(c) = 1 - max(base^c, floor).
        floor: the exploration floor in [MIN_FLOOR, 1): a candidate is generated with probability at least this.
        target: the zero-variance share of generated observations the base steers towards, in [0, 1).
        rate: the base's adaptation step (> 0).
    """

    base: float = 0.5
    floor: float = 0.01
    target: float = 0.25
    rate: float = 0.01
    # prompt key -> zero-variance observations in a row, candidates only (a streak of 0 has no entry): the record,
    # which checkpoints carry with every batch, grows with the prompts that are flat, not with the dataset
    streaks: Dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        problems = self.problems(self.base, self.floor, self.target, self.rate)
        if problems:
            raise InvalidOptions("invalid prompt-skip parameters", problems)

    @staticmethod
    def problems(base, floor, target, rate) -> List[Problem]:
        """Every invalid parameter, named as here (``base``, ...); empty when all are valid."""
        found = []
        if not (is_real(base) and BASE_MIN <= base <= BASE_MAX):
            found.append(Problem("base", base, f"must be a number in [{BASE_MIN}, {BASE_MAX}]"))
        if not (is_real(floor) and MIN_FLOOR <= floor < 1.0):
            found.append(Problem("floor", floor, f"must be a number in [{MIN_FLOOR}, 1) (the exploration floor)"))
        if not (is_real(target) and 0.0 <= target < 1.0):
            found.append(Problem("target", target, "must be a number in [0, 1)"))
        if not (is_real(rate) and rate > 0.0):
            found.append(Problem("rate", rate, "must be a number > 0"))
        return found

    def streak(self, key: str) -> int:
        return self.streaks.get(key, 0)

    def is_candidate(self, key: str) -> bool:
        """Whether ``key``'s latest observation had zero reward variance (so it may be skipped)."""
        return self.streak(key) > 0

    def skip_probability(self, key: str) -> float:
        """q(c) = 1 - max(base^c, floor) for the prompt's streak c; 0 for a prompt that is no candidate."""
        streak = self.streak(key)
        return 0.0 if streak == 0 else 1.0 - max(self.base**streak, self.floor)

    def skips(self, key: str, uniform: float) -> bool:
        """Skip ``key`` now? ``uniform`` is the prompt's draw in [0, 1); a prompt that is no candidate never is."""
        return uniform < self.skip_probability(key)

    def observe(self, key: str, rewards: Iterable[float]) -> bool:
        """Record one observation of ``key`` (a group's rewards); returns whether they were all equal."""
        flat = zero_variance(rewards)
        if flat:
            self.streaks[key] = min(self.streak(key) + 1, MAX_STREAK)
        else:
            self.streaks.pop(key, None)
        return flat

    def adapt(self, zero_variance_share: Optional[float], candidates_drawn: int) -> float:
        """Move the base by ``-rate * (share - target)`` within [BASE_MIN, BASE_MAX] after a batch that drew at
        least one candidate; unchanged otherwise (no windup) or without observations (``share`` None)."""
        if zero_variance_share is not None and not 0.0 <= zero_variance_share <= 1.0:
            raise ValueError(f"zero_variance_share must be in [0, 1], got {zero_variance_share!r}")
        if candidates_drawn > 0 and zero_variance_share is not None:
            moved = self.base - self.rate * (zero_variance_share - self.target)
            self.base = min(max(moved, BASE_MIN), BASE_MAX)
        return self.base

    def state_dict(self) -> Dict:
        """What a checkpoint keeps: the base and every candidate's streak."""
        return {"base": self.base, "streaks": dict(self.streaks)}

    def load_state_dict(self, state: Dict) -> None:
        # other keys are ignored: checkpoints of runs with the removed --d3s.pilot_history also hold a "mixed" record
        self.base = min(max(float(state["base"]), BASE_MIN), BASE_MAX)
        self.streaks = {key: min(int(streak), MAX_STREAK) for key, streak in state["streaks"].items()}
