import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.advantages import ADVANTAGE_ESTIMATORS, group_advantages

PROPERTY = settings(max_examples=200, deadline=None)


def openrlhf_shaped_rewards(per_experience_rewards, per_experience_index, n_samples_per_prompt, estimator):
    """OpenRLHF 0.11.2 RemoteExperienceMaker.compute_advantages_and_returns, reward-shaping part, restated
    literally (experiences carry rewards and their rollout-batch positions in arbitrary order)."""
    per_experience_rewards = [r.to(torch.promote_types(r.dtype, torch.float32)) for r in per_experience_rewards]
    exp_len = [len(index) for index in per_experience_index]
    indices = torch.tensor(list(itertools.chain.from_iterable(per_experience_index)))
    raw_rewards = torch.cat(per_experience_rewards, dim=0)
    rewards = torch.empty_like(raw_rewards)
    rewards[indices] = raw_rewards
    rewards = rewards.reshape(-1, n_samples_per_prompt)
    if estimator == "rloo":
        baseline = (rewards.sum(-1, keepdim=True) - rewards) / (n_samples_per_prompt - 1)
        rewards = rewards - baseline
    elif estimator in ["reinforce_baseline", "dr_grpo"]:
        rewards = rewards - rewards.mean(-1, keepdim=True)
    elif estimator == "group_norm":
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
    return rewards.reshape(-1)[indices].split(exp_len)


@st.composite
def reward_tables(draw, min_group=1, any_float=False):
    """(B, G) rewards: binary, or multiples of 1/64 in [-10, 10] (sums exact, so the compared formulas see the
    same statistics), or with any_float any fp32 value (for bit-for-bit comparisons of identical ops)."""
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(min_group, 8))
    if draw(st.booleans()):
        values = st.sampled_from([0.0, 1.0])
    elif any_float:
        values = st.floats(-10, 10, allow_nan=False, width=32)
    else:
        values = st.integers(-640, 640).map(lambda i: i / 64)
    flat = draw(st.lists(values, min_size=rows * cols, max_size=rows * cols))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    return torch.tensor(flat).reshape(rows, cols).to(dtype)


@PROPERTY
@given(
    reward_tables(min_group=2, any_float=True),
    st.sampled_from(ADVANTAGE_ESTIMATORS),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_full_groups_are_bit_identical_to_openrlhf(rewards, estimator, num_experiences, rng):
    rows, cols = rewards.shape
    positions = list(range(rows * cols))
    rng.shuffle(positions)
    cuts = sorted(rng.sample(range(1, rows * cols), min(num_experiences - 1, rows * cols - 1)))
    chunks = [positions[a:b] for a, b in zip([0] + cuts, cuts + [rows * cols])]
    flat = rewards.reshape(-1)
    upstream = openrlhf_shaped_rewards([flat[c] for c in chunks], chunks, cols, estimator)
    upstream_table = torch.empty(rows * cols, dtype=upstream[0].dtype)
    for chunk, values in zip(chunks, upstream):
        upstream_table[chunk] = values
    ours = group_advantages(rewards, estimator)
    assert ours.dtype == upstream_table.dtype
    assert torch.equal(ours.reshape(-1), upstream_table), (ours, upstream_table)


def test_hand_computed_full_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(
        group_advantages(rewards, "group_norm"),
        torch.tensor([[0.5 / (s + 1e-9), -0.5 / (s + 1e-9), -0.5 / (s + 1e-9), 0.5 / (s + 1e-9)], [0.0] * 4]),
    )
    expected_centred = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4])
    torch.testing.assert_close(group_advantages(rewards, "dr_grpo"), expected_centred)
    torch.testing.assert_close(group_advantages(rewards, "reinforce_baseline"), expected_centred)
    # rloo: r - (sum - r) / 3 -> 1 - 1/3, 0 - 2/3
    torch.testing.assert_close(
        group_advantages(rewards, "rloo"), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4])
    )


def test_hand_computed_subsets():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]])
    kept = torch.tensor([[True, True, False, False, True]])  # kept rewards 1, 0, 1
    mean, std = 2 / 3, math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    torch.testing.assert_close(
        group_advantages(rewards, "group_norm", kept),
        torch.tensor([[(1 - mean) / std, (0 - mean) / std, 0.0, 0.0, (1 - mean) / std]]),
    )
    torch.testing.assert_close(
        group_advantages(rewards, "dr_grpo", kept), torch.tensor([[1 / 3, -2 / 3, 0.0, 0.0, 1 / 3]])
    )
    # rloo over 3 kept: 1 - (0 + 1) / 2, 0 - (1 + 1) / 2
    torch.testing.assert_close(group_advantages(rewards, "rloo", kept), torch.tensor([[0.5, -1.0, 0.0, 0.0, 0.5]]))


@PROPERTY
@given(reward_tables(), st.sampled_from(ADVANTAGE_ESTIMATORS), st.data())
def test_subset_statistics_equal_the_formula_on_the_kept_members_alone(rewards, estimator, data):
    flat = data.draw(st.lists(st.booleans(), min_size=rewards.numel(), max_size=rewards.numel()))
    kept = torch.tensor(flat).reshape(rewards.shape)
    result = group_advantages(rewards, estimator, kept)
    assert torch.isfinite(result).all()
    assert (result[~kept] == 0).all()
    for row in range(rewards.shape[0]):
        members = rewards[row][kept[row]].unsqueeze(0)
        if members.shape[1] <= 1:
            assert (result[row] == 0).all()
        else:
            torch.testing.assert_close(
                result[row][kept[row]], group_advantages(members, estimator)[0], atol=1e-5, rtol=1e-5
            )


@PROPERTY
@given(reward_tables(min_group=2), st.sampled_from(ADVANTAGE_ESTIMATORS))
def test_everything_kept_equals_the_full_group(rewards, estimator):
    torch.testing.assert_close(
        group_advantages(rewards, estimator, torch.ones(rewards.shape, dtype=torch.bool)),
        group_advantages(rewards, estimator),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_rows_with_zero_or_one_kept_member_and_singleton_groups_are_finite_zero(estimator):
    rewards = torch.tensor([[1.0, 0.0, 3.0], [5.0, 1.0, 2.0], [0.0, 1.0, 1.0]])
    kept = torch.tensor([[False, False, False], [False, True, False], [True, False, True]])
    result = group_advantages(rewards, estimator, kept)
    assert torch.isfinite(result).all()
    assert (result[:2] == 0).all()
    assert group_advantages(torch.tensor([[3.0], [7.0]]), estimator).tolist() == [[0.0], [0.0]]


def test_inputs_are_not_modified_and_low_precision_is_promoted():
    rewards = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float16)
    snapshot = rewards.clone()
    for estimator in ADVANTAGE_ESTIMATORS:
        assert group_advantages(rewards, estimator).dtype == torch.float32
        assert group_advantages(rewards, estimator, torch.tensor([[True, True, False]])).dtype == torch.float32
    assert torch.equal(rewards, snapshot)
    assert group_advantages(rewards.double(), "rloo").dtype == torch.float64


def test_non_contiguous_input_gives_the_contiguous_result():
    table = torch.randn(8, 5)
    transposed = table.t()
    assert torch.equal(
        group_advantages(transposed, "group_norm"), group_advantages(transposed.contiguous(), "group_norm")
    )


@pytest.mark.parametrize(
    "rewards, estimator, kept, fragment",
    [
        (torch.ones(2, 3), "gae", None, "estimator"),
        (torch.ones(2, 3), "reinforce", None, "estimator"),
        (torch.ones(6), "rloo", None, "2-D"),
        (torch.ones(2, 0), "rloo", None, "G >= 1"),
        (torch.ones(2, 3), "rloo", torch.ones(2, 3), "bool"),
        (torch.ones(2, 3), "rloo", torch.ones(3, 2, dtype=torch.bool), "shape"),
    ],
)
def test_rejects_bad_input(rewards, estimator, kept, fragment):
    with pytest.raises(ValueError, match=fragment):
        group_advantages(rewards, estimator, kept)
