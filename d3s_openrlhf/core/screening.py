"""Screened generation: a few pilot rollouts decide which prompts get the rest of their group.

Every prompt drawn for training first gets k pilot rollouts (``--d3s.pilot_rollouts``, 2 <= k < G). A pilot whose
k rewards are all equal (``core.prompt_skip.zero_variance``) screens the prompt out: it is not trained and its slot
goes to the next prompt. Otherwise the other G - k rollouts are generated and the whole group of G goes on to
rewards, selection and training. SPEED-RL (arXiv 2506.09016) screens the same way (continue when the screening
pass rate lies strictly between 0 and 1); Pilot-Commit (arXiv 2605.26606) with a band.

A pilot with variance guarantees a group with variance, so every group that reaches training has a
policy-gradient signal. A screened-out prompt might have shown variance in its full group (a false reject): with
pass rate p, a pilot of k is all-equal with probability p^k + (1-p)^k, the full group of G with p^G + (1-p)^G.

Screening conditions a group on its first k rewards not being all equal, so its pilots are enriched in the minority
outcome: at p = 0.9 and k = 4 of G = 16 the group's expected mean reward is 0.852, not 0.9, and every advantage
differs from GRPO's for the same prompt. :func:`screening_weights` undoes that conditioning exactly, for every
group-relative estimator and every selection within the group (docs/generation.md, "Screened groups are
weighted", which also says what it does not make exact).

Keeping the engines busy: pilots are dispatched ahead so that the batch fills without a serial tail of one prompt
at a time. With ``needed`` groups still to start and an acceptance estimate a, the pilots in flight are topped up
to ceil(needed / a) (:func:`pilots_to_dispatch`) whenever a pilot or a group returns; the estimate counts the run's
pilots, the batch's so far included, with older batches decayed and an optimistic prior (:class:`AcceptanceEstimate`).
So the first batch dispatches exactly B pilots and provisions for the acceptance it sees as they return, and later
batches start from the acceptance of the last ones. Pilots that pass after the batch is full wait for the next
batch, which takes them first; the pilots in flight are capped (:func:`pilot_room`) so that at most B wait, and none
is more than one policy update old.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch

MIN_ACCEPTANCE = 0.1  # never provision more than 10 pilots per group still needed
PRIOR_PILOTS = 2.0  # the estimate starts as if 2 pilots had passed: one flat pilot does not multiply the dispatch


def screening_weights(rewards: torch.Tensor, pilots: int) -> torch.Tensor:
    """Importance weights (B,) of screened groups of rewards (B, G) whose pilots were ``pilots`` = k of them:

        w = 1 / P(k of the group's G rollouts, drawn without replacement, are not all equal | its rewards)
          = C(G, k) / (C(G, k) - sum_v C(c_v, k))          c_v: how many of the G rewards equal v

    Why it is exact: the G rollouts of a prompt are exchangeable, so given the multiset of a group's rewards its k
    pilots are a uniformly random k-subset of them, and screening keeps the group with exactly that probability
    P(pass | rewards). A screened group therefore has the density of an unscreened group times P(pass | rewards) /
    P(pass), and weighting it by 1 / P(pass | rewards) makes the expectation, per prompt drawn (a screened-out
    draw counting 0), of any function of the group's rewards and responses that vanishes on an all-equal group
    (every group-relative advantage, with or without a selection of the group's rollouts) equal to its expectation
    without screening. The weight depends on the rewards alone, not on the prompt's pass rate; it lies in [1, G / k]
    (G / k for a group with a single minority reward), and its mean over the groups that pass is
    P(group not all equal) / P(pilot not all equal) >= 1: the accepted groups stand in for the false rejects.

    Rewards compare by exact equality, as the screen does. Raises ValueError on a row whose G rewards are all equal:
    it cannot have passed a screen (its rewards are not those the pilots were screened on).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be a 2-D tensor of shape (B, G), got shape {tuple(rewards.shape)}")
    group_size = rewards.shape[1]
    if not 2 <= pilots < group_size:
        raise ValueError(f"pilots must lie in [2, G) = [2, {group_size}), got {pilots}")
    equal = (rewards.unsqueeze(-1) == rewards.unsqueeze(-2)).sum(-1).to(torch.float64)  # (B, G): c of each member
    # C(c, k) / C(G, k) as a product of k ratios (no overflow at large G); 0 where c < k
    share = torch.ones_like(equal)
    for t in range(pilots):
        share = share * (equal - t).clamp(min=0) / (group_size - t)
    flat = (share / equal).sum(-1)  # each value's C(c_v, k) spread over its c_v members
    passes = 1.0 - flat
    impossible = passes <= 1e-12
    if bool(impossible.any()):
        rows = impossible.nonzero().squeeze(1).tolist()
        raise ValueError(
            f"groups {rows[:8]} have all {group_size} rewards equal, so no pilot of {pilots} could have passed the "
            "screen: the rewards given here must be those the pilots were screened on"
        )
    return 1.0 / passes


def pilots_to_dispatch(needed: int, pilots_in_flight: int, acceptance: float, room: int) -> int:
    """New pilots to dispatch so that the pilots in flight are expected to start the ``needed`` groups, with at most
    ``room`` pilots in flight:

        max(0, min(ceil(needed / max(acceptance, MIN_ACCEPTANCE)), room) - pilots_in_flight)
    """
    if needed <= 0:
        return 0
    wanted = math.ceil(needed / max(min(acceptance, 1.0), MIN_ACCEPTANCE) - 1e-9)
    return max(0, min(wanted, room) - pilots_in_flight)


def pilot_room(needed: int, batch: int, carried: int) -> int:
    """The most pilots in flight that keep the accepted pilots waiting for the next batch at ``batch`` at most:
    ``needed + batch - carried``. Pilots accepted beyond the batch's need wait for the next one, which takes them
    first; so no pilot waits longer than one batch (one policy update old, as in async mode)."""
    return needed + max(0, batch - carried)


@dataclass
class AcceptanceEstimate:
    """The share of pilots that pass (have reward variance), counted over the run with older batches decayed by
    ``decay`` per batch, and ``PRIOR_PILOTS`` that passed: 1 before any pilot returned (the first dispatch is one
    pilot per slot)."""

    decay: float = 0.5
    accepted: float = 0.0
    pilots: float = 0.0

    @property
    def value(self) -> float:
        return self.with_batch(0, 0)

    def with_batch(self, accepted: int, pilots: int) -> float:
        """The estimate with the batch in progress counted in (its pilots so far), without folding it in:
        (accepted + PRIOR_PILOTS) / (pilots + PRIOR_PILOTS) over the decayed counts."""
        return (self.accepted + accepted + PRIOR_PILOTS) / (self.pilots + pilots + PRIOR_PILOTS)

    def update(self, accepted: int, pilots: int) -> float:
        """Fold in one batch's pilots; returns the new estimate."""
        self.accepted = self.decay * self.accepted + accepted
        self.pilots = self.decay * self.pilots + pilots
        return self.value

    def state_dict(self) -> Dict[str, float]:
        return {"accepted": self.accepted, "pilots": self.pilots}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.accepted, self.pilots = float(state["accepted"]), float(state["pilots"])
