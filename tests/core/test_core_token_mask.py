import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.token_mask import token_keep_mask, token_mask_metrics

PROPERTY = settings(max_examples=200, deadline=None)


def expected_count(fraction, n):
    if n == 0:
        return 0
    return max(1, math.ceil(Fraction(fraction).limit_denominator(10**6) * n))


def reference_mask(advantages, entropy, action_mask, fraction, scope):
    """Brute force: list the valid positions, sort by (score desc, row-major position asc), take the first
    ceil(K * n) and drop those with score 0 (they sort after every positive score)."""
    scores = (advantages.float().abs() * entropy.float()).tolist()
    mask = action_mask.bool().tolist()
    rows, cols = action_mask.shape
    keep = [[False] * cols for _ in range(rows)]
    groups = [list(range(rows))] if scope == "batch" else [[r] for r in range(rows)]
    for group in groups:
        cands = [(-scores[r][c], r, c) for r in group for c in range(cols) if mask[r][c]]
        cands.sort()
        for negative_score, r, c in cands[: expected_count(fraction, len(cands))]:
            keep[r][c] = negative_score < 0
    return torch.tensor(keep, dtype=torch.bool).reshape(rows, cols)


@st.composite
def token_batches(draw):
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 12))
    size = rows * cols
    # A small value pool creates many ties (and many zeros); continuous values exercise the ordering.
    if draw(st.booleans()):
        values = st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0])
    else:
        values = st.floats(-5, 5, allow_nan=False, width=32)
    entropies = st.sampled_from([0.0, 0.25, 1.0]) | st.floats(0, 4, allow_nan=False, width=32)
    # zero-heavy regimes: every advantage 0 (zero-variance groups), every entropy 0, or mostly zeros
    regime = draw(st.sampled_from(["mixed", "zero_advantages", "zero_entropy", "sparse"]))
    if regime == "zero_advantages":
        adv = [draw(st.sampled_from([0.0, -0.0]))] * size
    elif regime == "sparse":
        adv = draw(st.lists(st.sampled_from([0.0] * 5 + [1.0, -2.0]), min_size=size, max_size=size))
    else:
        adv = draw(st.lists(values, min_size=size, max_size=size))
    if regime == "zero_entropy":
        ent = [0.0] * size
    else:
        ent = draw(st.lists(entropies, min_size=size, max_size=size))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(rows, cols)
    empty_rows = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    mask[torch.tensor(empty_rows)] = False
    fraction = draw(st.floats(1e-6, 1.0) | st.sampled_from([0.05, 0.07, 0.1, 0.2, 0.25, 0.5, 0.7, 1.0]))
    return torch.tensor(adv).reshape(rows, cols), torch.tensor(ent).reshape(rows, cols), mask, fraction


@PROPERTY
@given(token_batches(), st.sampled_from(["batch", "sequence"]))
def test_matches_brute_force_reference(batch, scope):
    adv, ent, mask, fraction = batch
    keep = token_keep_mask(adv, ent, mask, fraction, scope=scope)
    assert keep.dtype == torch.bool and keep.shape == mask.shape
    assert torch.equal(keep, reference_mask(adv, ent, mask, fraction, scope))


@PROPERTY
@given(token_batches(), st.sampled_from(["batch", "sequence"]))
def test_count_order_and_masking_properties(batch, scope):
    adv, ent, mask, fraction = batch
    keep = token_keep_mask(adv, ent, mask, fraction, scope=scope)
    scores = adv.abs() * ent
    assert not (keep & ~mask).any()
    units = [(slice(None), slice(None))] if scope == "batch" else [(r, slice(None)) for r in range(mask.shape[0])]
    for unit in units:
        unit_keep, unit_mask, unit_scores = keep[unit], mask[unit], scores[unit]
        n = int(unit_mask.sum())
        positives = int((unit_mask & (unit_scores > 0)).sum())
        assert int(unit_keep.sum()) == min(expected_count(fraction, n), positives)
        assert (unit_scores[unit_keep] > 0).all()
        dropped = unit_mask & ~unit_keep
        if unit_keep.any() and dropped.any():
            assert unit_scores[unit_keep].min() >= unit_scores[dropped].max()


@PROPERTY
@given(st.integers(1, 1000), st.integers(0, 3000))
def test_decimal_fractions_give_exact_ceilings(per_mille, n):
    # fraction = per_mille / 1000 as a double; the count must be the exact decimal ceiling.
    adv = torch.ones(1, max(n, 1))
    mask = torch.zeros(1, max(n, 1), dtype=torch.bool)
    mask[0, :n] = True
    keep = token_keep_mask(adv, torch.rand(1, max(n, 1)) + 0.1, mask, per_mille / 1000)
    exact = -(-per_mille * n // 1000)
    assert int(keep.sum()) == (max(exact, 1) if n else 0)


def test_float_artifacts_do_not_add_a_token():
    assert 0.07 * 100 > 7  # the double product overshoots; the mask must still keep 7
    mask = torch.ones(1, 100, dtype=torch.bool)
    keep = token_keep_mask(torch.ones(1, 100), torch.rand(1, 100) + 0.1, mask, 0.07)
    assert int(keep.sum()) == 7
    keep = token_keep_mask(
        torch.ones(10, 10), torch.rand(10, 10) + 0.1, torch.ones(10, 10, dtype=torch.bool), 0.7, scope="sequence"
    )
    assert keep.sum(1).tolist() == [7] * 10


def test_known_example_both_scopes():
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.5, 0.5, -4.0, 0.0]])
    ent = torch.tensor([[1.0, 1.0, 2.0, 9.0], [2.0, 2.0, 0.1, 5.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    # scores: row0 [1, 2, 1, (27 masked)], row1 [1, 1, 0.4, 0]; 7 valid, K = 0.4 -> ceil(2.8) = 3.
    keep = token_keep_mask(adv, ent, mask, 0.4)
    # 2 is kept; four tokens tie at 1, the two earliest in row-major order (both in row 0) win.
    assert keep.tolist() == [[True, True, True, False], [False, False, False, False]]
    keep = token_keep_mask(adv, ent, mask, 0.4, scope="sequence")
    # row0: ceil(1.2) = 2 of 3 -> 2 and the first 1; row1: ceil(1.6) = 2 of 4 -> the two 1s.
    assert keep.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_sequence_scope_keeps_at_least_one_per_non_empty_row():
    mask = torch.tensor([[True] * 5, [False] * 5, [True, False, False, False, False]])
    keep = token_keep_mask(torch.randn(3, 5), torch.rand(3, 5) + 0.1, mask, 1e-9, scope="sequence")
    assert keep.sum(1).tolist() == [1, 0, 1]


def test_fraction_one_keeps_the_positive_scores_and_empty_mask_keeps_nothing():
    mask = torch.rand(4, 9) > 0.5
    adv = torch.randn(4, 9).masked_fill(torch.rand(4, 9) > 0.7, 0.0)
    ent = torch.rand(4, 9).masked_fill(torch.rand(4, 9) > 0.8, 0.0)
    for scope in ("batch", "sequence"):
        assert torch.equal(token_keep_mask(adv, ent, mask, 1.0, scope=scope), mask & (adv.abs() * ent > 0))
        empty = torch.zeros(4, 9, dtype=torch.bool)
        assert not token_keep_mask(torch.randn(4, 9), torch.rand(4, 9), empty, 0.3, scope=scope).any()


def test_zero_score_tokens_never_fill_the_budget():
    # Regression: the budget ceil(0.5 * 12) = 6 used to be filled with zero-score tokens by earliest position
    # (a kept rollout with advantage 0 in row 1, an entropy-0 token in row 2), inflating the kept count.
    adv = torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 1.0]])
    mask = torch.ones(3, 4, dtype=torch.bool)
    expected = torch.zeros(3, 4, dtype=torch.bool)
    expected[0, 2] = expected[2, 1] = True
    assert torch.equal(token_keep_mask(adv, ent, mask, 0.5), expected)
    # sequence scope: 2 of each row's 4 tokens at most, row 1 (advantage 0 throughout) keeps none
    assert torch.equal(token_keep_mask(adv, ent, mask, 0.5, scope="sequence"), expected)
    for scope in ("batch", "sequence"):
        assert not token_keep_mask(torch.zeros(3, 4), ent, mask, 0.5, scope=scope).any()
        assert not token_keep_mask(adv, torch.zeros(3, 4), mask, 0.9, scope=scope).any()


@pytest.mark.parametrize("shape", [(1, 1), (1, 17), (17, 1), (3, 0), (0, 5)])
@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_odd_shapes(shape, scope):
    adv, ent = torch.randn(shape), torch.rand(shape)
    mask = torch.ones(shape, dtype=torch.bool)
    keep = token_keep_mask(adv, ent, mask, 0.5, scope=scope)
    assert keep.shape == shape
    assert torch.equal(keep, reference_mask(adv, ent, mask, 0.5, scope))


def test_low_precision_inputs_and_integer_mask():
    adv = torch.randn(4, 8)
    ent = torch.rand(4, 8)
    mask = torch.rand(4, 8) > 0.3
    expected = reference_mask(adv.half(), ent.bfloat16(), mask, 0.3, "batch")
    assert torch.equal(token_keep_mask(adv.half(), ent.bfloat16(), mask.long(), 0.3), expected)


def test_garbage_at_masked_positions_is_ignored():
    adv = torch.tensor([[1.0, float("nan"), 2.0]])
    ent = torch.tensor([[1.0, 1.0, float("inf")]])
    mask = torch.tensor([[True, False, False]])
    assert token_keep_mask(adv, ent, mask, 0.5).tolist() == [[True, False, False]]


@pytest.mark.parametrize("fraction", [0, 0.0, -0.1, 1.0000001, 2, float("nan"), float("inf"), True, "0.5", None])
def test_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="fraction"):
        token_keep_mask(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), fraction)


def test_rejects_bad_shapes_scope_and_scores():
    ones = torch.ones(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="same shape"):
        token_keep_mask(ones, torch.ones(2, 4), mask, 0.5)
    with pytest.raises(ValueError, match="same shape"):
        token_keep_mask(ones, ones, torch.ones(3, 2, dtype=torch.bool), 0.5)
    with pytest.raises(ValueError, match=r"\(S, T\)"):
        token_keep_mask(torch.ones(6), torch.ones(6), torch.ones(6, dtype=torch.bool), 0.5)
    with pytest.raises(ValueError, match="torch.Tensor"):
        token_keep_mask([[1.0]], torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), 0.5)
    with pytest.raises(ValueError, match="scope"):
        token_keep_mask(ones, ones, mask, 0.5, scope="row")
    for bad in (float("nan"), float("inf")):
        adv = ones.clone()
        adv[1, 2] = bad
        for scope in ("batch", "sequence"):
            with pytest.raises(ValueError, match="finite"):
                token_keep_mask(adv, ones, mask, 0.5, scope=scope)


def test_metrics():
    keep = torch.tensor([[True, False, False], [False, True, False]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    ent = torch.tensor([[1.0, 3.0, 100.0], [2.0, 4.0, 5.0]])
    m = token_mask_metrics(keep, mask, ent)
    assert m == {
        "valid_tokens": 5.0,
        "kept_tokens": 2.0,
        "kept_fraction": 0.4,
        "entropy_mean_all": 3.0,
        "entropy_mean_kept": 2.5,
    }
    # with the advantages: candidates whose |A| * H is > 0 (row 1 has advantage 0; padding never counts)
    adv = torch.tensor([[-0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    assert token_mask_metrics(keep, mask, ent, adv) == {**m, "scored_tokens": 2.0}
    empty = token_mask_metrics(torch.zeros(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool), ent[:1, :2])
    assert empty["kept_fraction"] == 0.0 and empty["entropy_mean_all"] == 0.0 and empty["entropy_mean_kept"] == 0.0
    with pytest.raises(ValueError, match="same shape"):
        token_mask_metrics(keep, mask[:1], ent)


@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_same_mask_on_every_device(device, scope):
    adv = torch.randint(-1, 2, (6, 20)).float() * torch.rand(6, 1)
    ent = torch.rand(6, 20).masked_fill(torch.rand(6, 20) > 0.8, 0.0)
    mask = torch.rand(6, 20) > 0.2
    for fraction in (0.05, 0.3, 0.9, 1.0):
        expected = reference_mask(adv, ent, mask, fraction, scope)
        got = token_keep_mask(adv.to(device), ent.to(device), mask.to(device), fraction, scope=scope)
        assert got.device.type == device and torch.equal(got.cpu(), expected)
