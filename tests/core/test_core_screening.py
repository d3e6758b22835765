"""Screening by pilots, the pure part (``core.screening``): how many pilots to keep in flight, the cap that keeps
waiting pilots fresh, the acceptance estimate, the weights that undo the screen's conditioning."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.advantages import group_advantages
from d3s_openrlhf.core.screening import (
    MIN_ACCEPTANCE,
    PRIOR_PILOTS,
    AcceptanceEstimate,
    pilot_room,
    pilots_to_dispatch,
    screening_weights,
)
from d3s_openrlhf.core.selection import select_rollouts

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


# ── the weights that undo the screen's conditioning ──


def brute_force_weights(rewards, pilots):
    """1 / the share of the k-subsets of each row whose rewards are not all equal, by enumeration."""
    weights = []
    for row in rewards.tolist():
        subsets = list(itertools.combinations(row, pilots))
        passing = sum(len(set(subset)) > 1 for subset in subsets)
        weights.append(len(subsets) / passing)
    return torch.tensor(weights, dtype=torch.float64)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), group_size=st.integers(3, 9))
def test_weights_equal_the_enumerated_pass_probability(data, group_size):
    pilots = data.draw(st.integers(2, group_size - 1))
    rows = data.draw(st.integers(1, 5))
    values = st.sampled_from([0.0, 1.0, 0.5, -2.25])  # few values: ties of every size
    table = [data.draw(st.lists(values, min_size=group_size, max_size=group_size)) for _ in range(rows)]
    table = [row if len(set(row)) > 1 else [*row[:-1], row[-1] + 1.0] for row in table]
    rewards = torch.tensor(table, dtype=data.draw(st.sampled_from([torch.float32, torch.float64])))
    weights = screening_weights(rewards, pilots)
    torch.testing.assert_close(weights, brute_force_weights(rewards, pilots), rtol=1e-12, atol=0)
    assert bool((weights >= 1).all()) and bool((weights <= group_size / pilots + 1e-12).all())


def test_weights_at_the_sizes_users_run_and_refused_inputs():
    group_size = 256
    one_minority = torch.zeros(1, group_size)
    one_minority[0, 7] = 1.0
    assert screening_weights(one_minority, 16).item() == pytest.approx(group_size / 16, rel=1e-12)
    half = (torch.arange(group_size) % 2).float().unsqueeze(0)
    expected = 1 / (1 - 2 * math.comb(128, 16) / math.comb(group_size, 16))
    assert screening_weights(half, 16).item() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match=r"groups \[1\] have all 4 rewards equal"):
        screening_weights(torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]]), 2)
    for pilots in (1, 4):
        with pytest.raises(ValueError, match="pilots must lie in"):
            screening_weights(torch.tensor([[0.0, 1.0, 1.0, 1.0]]), pilots)


# The simulation: Bernoulli rewards at pass rate p, pilots of k of G = 16. Per prompt drawn (a draw screened
# out counts 0, as GRPO's flat groups do), the weighted advantages of screened groups must have the expectation of
# the same method's advantages without screening, for each outcome: S_r = sum of the advantages of the rollouts with
# reward r. That is what the policy gradient reads (a response's score given its reward does not depend on the
# group), so the batch's expected gradient is GRPO's, as with DAPO's filter.
SIM_GROUP, SIM_DRAWS = 16, 40_000


def _trained_advantages(method, rewards, generator):
    """(D, G) advantages of ``method`` as trained (0 where a rollout is not kept)."""
    if method == "GRPO":
        return group_advantages(rewards, "group_norm")
    if method == "D3S":  # full-group advantages, the N = 8 of 16 of maximal variance kept (mid-schedule)
        full = group_advantages(rewards, "group_norm")
        kept = _kept_mask(select_rollouts(full, 8, scope="intra", rule="max_var", generator=generator), rewards)
        return torch.where(kept, full, torch.zeros(()))
    # PODS: m = 4 of n = 16 of maximal reward variance, advantages recomputed over the kept subset
    kept = _kept_mask(select_rollouts(rewards, 4, scope="intra", rule="max_var", generator=generator), rewards)
    return group_advantages(rewards, "group_norm", kept=kept)


def _kept_mask(flat_index, rewards):
    kept = torch.zeros(rewards.numel(), dtype=torch.bool)
    kept[flat_index] = True
    return kept.view_as(rewards)


def _per_draw_outcome_sums(p, pilots, method, weighted, seed):
    """(D, 2): S_0 and S_1 of each draw; with ``pilots`` the draw is screened on its first k rewards."""
    generator = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(SIM_DRAWS, SIM_GROUP, generator=generator, dtype=torch.float64) < p).double()
    passed = torch.ones(SIM_DRAWS, dtype=torch.bool)
    if pilots:
        head = rewards[:, :pilots]
        passed = head.amax(-1) != head.amin(-1)
    sums = torch.zeros(SIM_DRAWS, 2, dtype=torch.float64)
    rows = rewards[passed]
    advantages = _trained_advantages(method, rows, generator)
    weight = screening_weights(rows, pilots) if pilots and weighted else torch.ones(len(rows), dtype=torch.float64)
    for outcome in (0, 1):
        sums[passed, outcome] = weight * (advantages * (rows == outcome)).sum(-1)
    return sums


def _z_scores(a, b):
    return (a.mean(0) - b.mean(0)) / (a.var(0) / len(a) + b.var(0) / len(b)).sqrt()


@pytest.mark.parametrize("method", ["GRPO", "D3S", "PODS"])
@pytest.mark.parametrize("pilots", [2, 4, 8])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_weighted_screened_groups_have_the_advantages_expected_without_screening(p, pilots, method):
    reference = _per_draw_outcome_sums(p, 0, method, weighted=False, seed=1)
    screened = _per_draw_outcome_sums(p, pilots, method, weighted=True, seed=2)
    assert _z_scores(screened, reference).abs().max() < 4.5


@pytest.mark.parametrize("method", ["GRPO", "D3S", "PODS"])
def test_the_simulation_sees_the_bias_of_unweighted_screened_groups(method):
    reference = _per_draw_outcome_sums(0.9, 0, method, weighted=False, seed=1)
    unweighted = _per_draw_outcome_sums(0.9, 4, method, weighted=False, seed=2)
    assert _z_scores(unweighted, reference).abs().max() > 10


def _screened_table(p, pilots, group_size=SIM_GROUP):
    """Every (pilot successes, rest successes) of Bernoulli(p) rewards: one row of rewards each, with its probability
    (pilots first) and whether the pilot passes."""
    rest = group_size - pilots
    rows, probabilities = [], []
    for head in range(pilots + 1):
        for tail in range(rest + 1):
            rows.append([1.0] * head + [0.0] * (pilots - head) + [1.0] * tail + [0.0] * (rest - tail))
            successes = head + tail
            ways = math.comb(pilots, head) * math.comb(rest, tail)
            probabilities.append(ways * p**successes * (1 - p) ** (group_size - successes))
    rewards = torch.tensor(rows, dtype=torch.float64)
    head = rewards[:, :pilots]
    return rewards, torch.tensor(probabilities, dtype=torch.float64), head.amax(-1) != head.amin(-1)


@pytest.mark.parametrize("pilots", [2, 4, 8])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_by_enumeration_weighted_groups_have_grpos_expected_advantages_exactly(p, pilots):
    """The exact version of the simulation for GRPO (group_norm): every reward configuration of a group of 16,
    weighted by its probability; per outcome, the expected sum of advantages per prompt drawn."""
    rewards, probability, passed = _screened_table(p, pilots)
    advantages = group_advantages(rewards, "group_norm")
    weights = torch.zeros_like(probability)
    weights[passed] = screening_weights(rewards[passed], pilots)
    for outcome in (0.0, 1.0):
        per_group = (advantages * (rewards == outcome)).sum(-1)
        # the table lists each configuration of pilot and rest counts once: the unscreened expectation is the same sum
        torch.testing.assert_close((probability * weights * per_group).sum(), (probability * per_group).sum())


def test_the_documented_bias_of_unweighted_screened_groups():
    """docs/generation.md's numbers at p = 0.9, k = 4, G = 16 (group_norm): the screened group's expected mean
    reward, and the mean advantage of the rollouts generated after the pilot, wrong and right, against GRPO's."""
    rewards, probability, passed = _screened_table(0.9, 4)
    conditional = probability * passed / (probability * passed).sum()
    assert (conditional * rewards.mean(-1)).sum().item() == pytest.approx(0.852, abs=5e-4)
    advantages = group_advantages(rewards, "group_norm")
    rest = torch.zeros_like(rewards, dtype=torch.bool)
    rest[:, 4:] = True
    for outcome, screened_mean, grpo_mean in ((0.0, -2.00, -2.48), (1.0, 0.39, 0.28)):
        members = rest & (rewards == outcome)
        mean = (conditional * (advantages * members).sum(-1)).sum() / (conditional * members.sum(-1)).sum()
        assert mean.item() == pytest.approx(screened_mean, abs=5e-3)
        everyone = rewards == outcome  # GRPO: every configuration, unconditioned
        grpo = (probability * (advantages * everyone).sum(-1)).sum() / (probability * everyone.sum(-1)).sum()
        assert grpo.item() == pytest.approx(grpo_mean, abs=5e-3)
