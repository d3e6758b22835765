import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.pass_at_k import (
    CORRECT_TOLERANCE,
    check_ks,
    is_correct,
    mean_pass_at_k,
    pass_at_k,
    powers_of_two_up_to,
)

PROPERTY = settings(max_examples=300, deadline=None)


def brute_force(outcomes, k):
    """Fraction of the k-subsets of one prompt's samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@st.composite
def prompts_and_k(draw):
    """Per-prompt outcome lists (n <= 9 each, n may differ between prompts) and a k <= min n."""
    count = draw(st.integers(1, 5))
    outcomes = [draw(st.lists(st.booleans(), min_size=1, max_size=9)) for _ in range(count)]
    k = draw(st.integers(1, min(len(o) for o in outcomes)))
    return outcomes, k


@PROPERTY
@given(prompts_and_k())
def test_pass_at_k_equals_every_k_subset_brute_force(case):
    outcomes, k = case
    n = np.array([len(o) for o in outcomes])
    c = np.array([sum(o) for o in outcomes])
    got = pass_at_k(n, c, k)
    expected = [brute_force(o, k) for o in outcomes]
    assert got.shape == (len(outcomes),)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert mean_pass_at_k(n, c, k) == pytest.approx(float(np.mean(expected)), abs=1e-12)


@PROPERTY
@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_the_binomial_form(case):
    n, c, k = case
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert float(pass_at_k(n, c, k)) == pytest.approx(exact, abs=1e-12)


@pytest.mark.parametrize("n", [1, 4, 32, 1024])
def test_edge_cases(n):
    assert pass_at_k(n, 0, 1) == 0.0
    assert pass_at_k(n, n, n) == 1.0
    assert pass_at_k(n, 1, n) == 1.0  # pass@n: any of the n
    assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)  # pass@1: the mean accuracy
    half = n // 2
    assert float(pass_at_k(n, half, 1)) == pytest.approx(half / n)


def test_large_n_is_stable_where_binomials_overflow():
    # C(1024, 512) is about 4.5e306 and C(2048, 1024) overflows float64; the product form stays in [0, 1]
    value = float(pass_at_k(2048, 3, 1024))
    assert value == pytest.approx(1 - math.comb(2045, 1024) / math.comb(2048, 1024), abs=1e-12)
    assert 0.0 <= value <= 1.0


def test_shapes_broadcast_and_empty():
    got = pass_at_k(np.array([[4, 4], [8, 8]]), np.array([[0, 4], [1, 2]]), 2)
    assert got.shape == (2, 2)
    assert pass_at_k(np.array([], dtype=int), np.array([], dtype=int), 1).shape == (0,)
    with pytest.raises(ValueError, match="no prompt"):
        mean_pass_at_k(np.array([], dtype=int), np.array([], dtype=int), 1)


@pytest.mark.parametrize(
    "n, c, k, match",
    [
        (4, 1, 5, "k = 5 exceeds"),
        (4, 5, 1, "0 <= c <= n"),
        (4, -1, 1, "0 <= c <= n"),
        (0, 0, 1, "n >= 1"),
        (4, 1, 0, "k must be an integer >= 1"),
        (4, 1, 1.5, "k must be an integer"),
        (4.0, 1, 1, "integer counts"),
    ],
)
def test_refuses_bad_counts(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_is_correct_rule():
    rewards = np.array([1.0, 0.0, 1.0 - CORRECT_TOLERANCE / 2, 0.1, 0.999, 1.5])
    assert is_correct(rewards).tolist() == [True, False, True, False, False, True]
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="non-finite reward at flat position"):
            is_correct([1.0, bad])


@pytest.mark.parametrize("n, ks", [(1, [1]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]), (32, [1, 2, 4, 8, 16, 32])])
def test_powers_of_two_up_to(n, ks):
    assert powers_of_two_up_to(n) == ks


def test_check_ks():
    assert check_ks([8, 1, 8], 32) == [1, 8]
    with pytest.raises(ValueError, match=r"k = \[64\] outside \[1, n = 32\]"):
        check_ks([1, 64], 32)
