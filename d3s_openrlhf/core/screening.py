"""Screened generation: a few pilot rollouts decide which prompts get the rest of their group.

Every prompt drawn for training first gets k pilot rollouts (``--d3s.pilot_rollouts``, 2 <= k < G). A pilot whose
k rewards are all equal (``core.prompt_skip.zero_variance``) screens the prompt out: it is not trained and its slot
goes to the next prompt. Otherwise the other G - k rollouts are generated and the whole group of G goes on to
rewards, selection and training. SPEED-RL (arXiv 2506.09016) screens the same way (continue when the screening
pass rate lies strictly between 0 and 1); Pilot-Commit (arXiv 2605.26606) with a band.

A pilot with variance guarantees a group with variance, so every group that reaches training has a
policy-gradient signal. A screened-out prompt might have shown variance in its full group (a false reject): with
pass rate p, a pilot of k is all-equal with probability p^k + (1-p)^k, the full group of G with p^G + (1-p)^G.

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

MIN_ACCEPTANCE = 0.1  # never provision more than 10 pilots per group still needed
PRIOR_PILOTS = 2.0  # the estimate starts as if 2 pilots had passed: one flat pilot does not multiply the dispatch


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
