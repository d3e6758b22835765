"""The prompt-skip policy alone (``core.prompt_skip``): history, candidates, adaptation, the floor, determinism."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.core.prompt_skip import PromptSkipPolicy
from d3s_openrlhf.core.selection import step_generator


def test_history_makes_candidates_after_window_zero_variance_groups_in_a_row():
    policy = PromptSkipPolicy(window=2)
    assert not policy.is_candidate("a")  # never generated: always generated
    assert policy.observe("a", [1.0, 1.0, 1.0]) is True
    assert not policy.is_candidate("a")  # one of two
    assert policy.observe("a", [0.0, 0.0]) is True  # all wrong counts as all right does: no signal either way
    assert policy.is_candidate("a")
    assert policy.observe("a", [1.0, 1.0]) and policy.streaks["a"] == 2  # capped at the window
    assert policy.observe("b", [0.0, 1.0]) is False and not policy.is_candidate("b")


def test_a_prompt_that_becomes_informative_again_comes_back():
    policy = PromptSkipPolicy(window=1, prob=0.9, max_prob=0.9)
    policy.observe("a", [1.0, 1.0])
    # the floor: at p = 0.9 the candidate is generated about one visit in ten, never never
    decisions = [policy.skips(["a"], step_generator(0, step))[0] for step in range(400)]
    assert 0 < decisions.count(False) < 80
    policy.observe("a", [1.0, 0.0])  # the visit that generated it found variance: no longer a candidate
    assert not policy.is_candidate("a") and policy.skips(["a"] * 50, step_generator(0, 0)) == [False] * 50


def test_only_candidates_draw_and_decisions_follow_the_seed():
    policy = PromptSkipPolicy(prob=0.5)
    for key in "ace":
        policy.observe(key, [0.0, 0.0])
    keys = list("abcdef")
    first = policy.skips(keys, step_generator(7, 3))
    assert first == policy.skips(keys, step_generator(7, 3))  # same (seed, step), same choices
    assert not any(first[i] for i in (1, 3, 5))  # b, d, f were never seen with zero variance
    generator = step_generator(7, 3)
    draws = torch.rand(3, generator=generator, dtype=torch.float64)  # one draw per candidate, in order
    assert [first[i] for i in (0, 2, 4)] == [bool(d < 0.5) for d in draws]
    across = {tuple(policy.skips(keys, step_generator(seed, 3))) for seed in range(16)}
    assert len(across) > 1  # the seed matters


def test_adaptation_steers_towards_the_target_and_never_reaches_one():
    policy = PromptSkipPolicy(target=0.25, rate=0.1, prob=0.5, max_prob=0.9)
    assert policy.adapt(0.75) == pytest.approx(0.55)  # more wasted groups than the target: skip more
    assert policy.adapt(0.0) == pytest.approx(0.525)  # fewer: explore more
    for _ in range(100):
        policy.adapt(1.0)
    assert policy.prob == 0.9  # the ceiling: a candidate is generated at least one visit in ten
    for _ in range(100):
        policy.adapt(0.0)
    assert policy.prob == 0.0
    with pytest.raises(ValueError, match="zero_variance_share"):
        policy.adapt(1.5)


@settings(max_examples=200, deadline=None)
@given(shares=st.lists(st.floats(0.0, 1.0), max_size=50), max_prob=st.floats(0.0, 0.99), rate=st.floats(0.001, 1.0))
def test_the_probability_stays_in_its_bounds(shares, max_prob, rate):
    policy = PromptSkipPolicy(max_prob=max_prob, rate=rate, prob=max_prob / 2)
    for share in shares:
        assert 0.0 <= policy.adapt(share) <= max_prob < 1.0


def test_state_round_trip_resumes_the_same_decisions():
    policy = PromptSkipPolicy(window=2, prob=0.6)
    for key, rewards in (("a", [0, 0]), ("a", [0, 0]), ("b", [1, 1]), ("b", [1, 1]), ("c", [0, 1])):
        policy.observe(key, rewards)
    policy.adapt(0.9)
    restored = PromptSkipPolicy(window=2)
    restored.load_state_dict(policy.state_dict())
    keys = list("abcab")
    assert restored.prob == policy.prob and restored.streaks == policy.streaks
    assert restored.skips(keys, step_generator(1, 9)) == policy.skips(keys, step_generator(1, 9))


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(window=0), "window"),
        (dict(target=1.0), "target"),
        (dict(max_prob=1.0), "max_prob"),
        (dict(rate=0.0), "rate"),
    ],
)
def test_bad_parameters(fields, match):
    with pytest.raises(ValueError, match=match):
        PromptSkipPolicy(**fields)
    with pytest.raises(ValueError, match="no rewards"):
        PromptSkipPolicy().observe("a", [])


def test_the_config_builds_the_policy_and_refuses_bad_flags():
    config = D3SConfig.from_flags({"preset": "grpo", "prompt_skip": "history", "skip_window": 2, "skip_rate": 0.2})
    assert config.enabled and config.skip_enabled and not config.samples_enabled and not config.tokens_enabled
    policy = config.skip_policy()
    assert (policy.window, policy.rate, policy.prob, policy.max_prob) == (2, 0.2, 0.5, 0.9)
    for flags, named in (
        ({"skip_max_prob": 1.0}, "--d3s.skip_max_prob"),
        ({"skip_target": -0.1}, "--d3s.skip_target"),
        ({"skip_window": 0}, "--d3s.skip_window"),
        ({"skip_rate": 0}, "--d3s.skip_rate"),
        ({"skip_init_prob": 0.95}, "--d3s.skip_init_prob"),
        ({"prompt_skip": "always"}, "--d3s.prompt_skip"),
    ):
        with pytest.raises(ValueError, match=named):
            D3SConfig.from_flags({"prompt_skip": "history", **flags})
    assert not D3SConfig().skip_enabled
