"""Screening by pilots, the pure part (``core.screening``): how many pilots to keep in flight, the cap that keeps
waiting pilots fresh, the acceptance estimate."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.screening import (
    MIN_ACCEPTANCE,
    PRIOR_PILOTS,
    AcceptanceEstimate,
    pilot_room,
    pilots_to_dispatch,
)

ROOMY = 10**6


def test_the_first_batch_dispatches_one_pilot_per_slot_and_later_ones_provision_for_rejects():
    assert pilots_to_dispatch(8, 0, AcceptanceEstimate().value, ROOMY) == 8
    assert pilots_to_dispatch(8, 0, 0.5, ROOMY) == 16
    assert pilots_to_dispatch(8, 10, 0.5, ROOMY) == 6  # tops up, never recalls
    assert pilots_to_dispatch(8, 30, 0.5, ROOMY) == 0
    assert pilots_to_dispatch(0, 0, 0.5, ROOMY) == 0
    assert pilots_to_dispatch(3, 0, 0.0, ROOMY) == math.ceil(3 / MIN_ACCEPTANCE)  # bounded by the minimum acceptance
    assert pilots_to_dispatch(8, 4, 0.25, room=12) == 8  # 32 wanted, 12 allowed in flight


@settings(max_examples=300, deadline=None)
@given(needed=st.integers(0, 64), in_flight=st.integers(0, 200), acceptance=st.floats(0.0, 1.0))
def test_in_flight_pilots_are_expected_to_fill_what_is_needed(needed, in_flight, acceptance):
    new = pilots_to_dispatch(needed, in_flight, acceptance, ROOMY)
    assert new >= 0
    if needed > 0:
        rate = max(acceptance, MIN_ACCEPTANCE)
        assert (in_flight + new) * rate >= needed - 1e-9  # enough expected passes
        assert new == 0 or (in_flight + new - 1) * rate < needed  # and not one more than that


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 32),
    returns=st.lists(st.booleans(), max_size=400),
    carried=st.integers(0, 32),
    acceptance=st.floats(0.0, 1.0),
)
def test_no_more_than_a_batch_of_pilots_ever_waits(batch, returns, carried, acceptance):
    """Simulate a batch: pilots return in any order, each passes or not; those that pass beyond the need wait."""
    carried = min(carried, batch)
    started = min(carried, batch)  # the batch takes the waiting pilots first
    waiting = carried - started
    in_flight = 0
    outcomes = iter(returns)
    while True:
        room = pilot_room(batch - started, batch, waiting)
        in_flight += pilots_to_dispatch(batch - started, in_flight, acceptance, room)
        if in_flight == 0:
            break
        passed = next(outcomes, True)  # once the list runs out, pilots pass (the batch must end)
        in_flight -= 1
        if passed and started < batch:
            started += 1
        elif passed:
            waiting += 1
        assert waiting <= batch
    assert started == batch


def test_the_estimate_decays_older_batches_and_counts_the_batch_in_progress():
    estimate = AcceptanceEstimate(decay=0.5)
    assert estimate.value == 1.0
    assert estimate.with_batch(0, 1) == PRIOR_PILOTS / (1 + PRIOR_PILOTS)  # one flat pilot: not a collapse
    assert estimate.update(2, 4) == (2 + PRIOR_PILOTS) / (4 + PRIOR_PILOTS)
    assert estimate.with_batch(3, 4) == (2 + 3 + PRIOR_PILOTS) / (4 + 4 + PRIOR_PILOTS)
    assert estimate.update(4, 4) == (0.5 * 2 + 4 + PRIOR_PILOTS) / (0.5 * 4 + 4 + PRIOR_PILOTS)
    restored = AcceptanceEstimate(decay=0.5)
    restored.load_state_dict(estimate.state_dict())
    assert restored.value == estimate.value
