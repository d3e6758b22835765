"""The prompt-skip policy alone (``core.prompt_skip``): streaks, the per-prompt probability, the floor, the
base's adaptation without windup, determinism, state."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.core.prompt_skip import BASE_MAX, BASE_MIN, MAX_STREAK, MIN_FLOOR, PromptSkipPolicy, zero_variance
from d3s_openrlhf.core.selection import keyed_uniform


def test_streaks_count_zero_variance_observations_in_a_row():
    policy = PromptSkipPolicy()
    assert not policy.is_candidate("a") and policy.skip_probability("a") == 0.0  # never seen: always generated
    assert policy.observe("a", [1.0, 1.0, 1.0]) is True and policy.streak("a") == 1
    assert policy.observe("a", [0.0, 0.0]) is True and policy.streak("a") == 2  # all wrong is no signal either
    assert policy.observe("a", [0.0, 1.0]) is False and policy.streak("a") == 0  # variance resets the record
    assert not policy.is_candidate("a")
    assert policy.streaks == {}  # the record holds the candidates only: it grows with the flat prompts


@pytest.mark.parametrize("base, floor", [(0.5, 0.01), (0.9, 0.05), (0.05, 0.3)])
def test_the_probability_is_the_streak_rule_with_its_floor(base, floor):
    policy = PromptSkipPolicy(base=base, floor=floor)
    for streak in range(1, 12):
        policy.observe("a", [1.0, 1.0])
        assert policy.skip_probability("a") == pytest.approx(1.0 - max(base**streak, floor))
        assert policy.skip_probability("a") <= 1.0 - floor


def test_a_prompt_that_becomes_informative_again_comes_back():
    policy = PromptSkipPolicy(base=0.05, floor=0.05)
    for _ in range(10):
        policy.observe("a", [1.0, 1.0])
    # the floor: generated about one visit in twenty, never never
    decisions = [policy.skips("a", keyed_uniform(0, "skip", step, "a")) for step in range(1000)]
    assert 20 < decisions.count(False) < 90
    policy.observe("a", [1.0, 0.0])  # the visit that generated it found variance: no longer a candidate
    assert not any(policy.skips("a", uniform) for uniform in (0.0, 0.5, 1.0 - 2.0**-53))


def test_a_candidate_is_skipped_when_its_draw_falls_below_its_probability():
    policy = PromptSkipPolicy(base=0.5)
    for key in "ace":
        policy.observe(key, [0.0, 0.0])
    for key in "ace":  # q = 1 - 0.5
        assert policy.skips(key, 0.0) and policy.skips(key, 0.4999) and not policy.skips(key, 0.5)
    assert not any(policy.skips(key, 0.0) for key in "bdf")  # never seen with zero variance: never skipped


def test_the_base_adapts_only_after_a_batch_with_candidates():
    policy = PromptSkipPolicy(base=0.5, target=0.25, rate=0.1)
    # no candidate drawn (the first pass): skipping could not change the share, so nothing winds up
    for _ in range(50):
        assert policy.adapt(0.0, candidates_drawn=0) == 0.5
        assert policy.adapt(1.0, candidates_drawn=0) == 0.5
    assert policy.adapt(0.75, candidates_drawn=3) == pytest.approx(0.45)  # more waste than the target: skip more
    assert policy.adapt(0.0, candidates_drawn=1) == pytest.approx(0.475)  # less: explore more
    assert policy.adapt(None, candidates_drawn=4) == pytest.approx(0.475)  # nothing observed
    with pytest.raises(ValueError, match="zero_variance_share"):
        policy.adapt(1.5, candidates_drawn=1)


@settings(max_examples=200, deadline=None)
@given(
    shares=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 3)), max_size=60),
    base=st.floats(BASE_MIN, BASE_MAX),
    floor=st.floats(MIN_FLOOR, 0.99),
    rate=st.floats(0.001, 1.0),
    streak=st.integers(1, 300),
)
def test_every_probability_keeps_the_floor(shares, base, floor, rate, streak):
    policy = PromptSkipPolicy(base=base, floor=floor, rate=rate)
    for _ in range(streak):
        policy.observe("a", [1.0, 1.0])
    for share, candidates in shares:
        assert BASE_MIN <= policy.adapt(share, candidates) <= BASE_MAX
        assert 0.0 < policy.skip_probability("a") <= 1.0 - floor + 1e-12
    assert policy.streak("a") == min(streak, MAX_STREAK)
    assert BASE_MAX**MAX_STREAK < MIN_FLOOR  # the cap changes no probability


def test_zero_variance_refuses_empty_and_non_finite_rewards():
    assert zero_variance([0.5, 0.5]) and not zero_variance([0.5, 0.25])
    with pytest.raises(ValueError, match="no rewards"):
        zero_variance([])
    with pytest.raises(ValueError, match="non-finite"):
        zero_variance([1.0, math.nan])


def test_state_round_trip_resumes_the_same_decisions():
    policy = PromptSkipPolicy(base=0.6)
    for key, rewards in (("a", [0, 0]), ("a", [0, 0]), ("b", [1, 1]), ("c", [0, 1])):
        policy.observe(key, rewards)
    policy.adapt(0.9, candidates_drawn=2)
    restored = PromptSkipPolicy()
    restored.load_state_dict(policy.state_dict())
    assert restored.base == policy.base and restored.streaks == policy.streaks
    uniforms = [keyed_uniform(1, "skip", 9, key) for key in "abc"]
    assert [restored.skips(k, u) for k, u in zip("abc", uniforms)] == [
        policy.skips(k, u) for k, u in zip("abc", uniforms)
    ]


def test_a_checkpoint_with_the_removed_mixed_record_resumes():
    # written by a version with --d3s.pilot_history: its "mixed" record is ignored
    restored = PromptSkipPolicy()
    restored.load_state_dict({"base": 0.6, "streaks": {"b": 1}, "mixed": ["a", "c"]})
    assert restored.base == 0.6 and restored.streaks == {"b": 1}
    assert restored.state_dict() == {"base": 0.6, "streaks": {"b": 1}}
    assert [restored.skip_probability(key) for key in "ac"] == [0.0, 0.0]  # never candidates: always generated


def test_bad_parameters_are_reported_together_with_their_requirements():
    problems = PromptSkipPolicy.problems(base=1.0, floor=0.0, target=1.0, rate=0.0)
    assert [parameter for parameter, _, _ in problems] == ["base", "floor", "target", "rate"]
    assert [problem.value for problem in problems] == [1.0, 0.0, 1.0, 0.0]
    assert problems[1].requirement == "must be a number in [0.01, 1) (the exploration floor)"
    # the message names the parameter, its value and the requirement (the same fields, for people)
    with pytest.raises(ValueError, match="floor=0.001: must be a number in \\[0.01, 1\\)") as refused:
        PromptSkipPolicy(floor=0.001)
    assert [problem.parameter for problem in refused.value.problems] == ["floor"]


def test_the_config_builds_the_policy_and_refuses_bad_flags():
    flags = {"preset": "grpo", "prompt_skip": "history", "schedule_steps": 10, "skip_base": 0.7, "skip_rate": 0.2}
    config = D3SConfig.from_flags(flags)
    assert config.enabled and config.skip_enabled and not config.samples_enabled
    policy = config.skip_policy()
    assert (policy.base, policy.rate, policy.floor, policy.target) == (0.7, 0.2, 0.01, 0.25)
    with pytest.raises(ValueError) as refused:  # every bad option at once
        D3SConfig.from_flags({**flags, "skip_floor": 0.0, "skip_target": -0.1, "skip_base": 2.0})
    for named in ("--d3s.skip_floor", "--d3s.skip_target", "--d3s.skip_base"):
        assert named in str(refused.value)
    assert not D3SConfig().skip_enabled


def test_skipping_requires_the_fixed_steps():
    with pytest.raises(ValueError, match=r"--d3s.schedule_steps=0: must be > 0 with .*cycling over the prompts"):
        D3SConfig.from_flags({"preset": "d3s", "prompt_skip": "history"})
    assert D3SConfig.from_flags({"preset": "grpo", "schedule_steps": 5, "prompt_skip": "history"}).skip_enabled
