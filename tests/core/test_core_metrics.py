"""A step's ``d3s/*`` metrics (``core.metrics.step_metrics``) against hand computations, and the engine's log-prob
gap (``core.metrics.logprob_gap``) against a loop, without Ray."""

import pytest
import torch

from d3s_openrlhf.core.advantages import group_advantages
from d3s_openrlhf.core.metrics import logprob_gap, step_metrics
from d3s_openrlhf.core.token_mask import token_keep_mask, token_mask_metrics

REWARDS = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.5, 1.0]])  # (B, G) = (3, 3); prompt 1 all equal


def test_samples_only():
    advantages = group_advantages(REWARDS, "dr_grpo").reshape(-1)
    kept = torch.tensor([0, 1, 6, 8])
    metrics = step_metrics(4, 1.0, REWARDS, 4, 20, 50, advantages=advantages, kept_advantages=advantages[kept])
    assert metrics == pytest.approx(
        {
            "d3s/n": 4.0,
            "d3s/k": 1.0,
            "d3s/kept_rollouts": 4.0,
            "d3s/kept_rollout_frac": 4 / 9,
            "d3s/candidate_tokens": 20.0,
            "d3s/kept_tokens": 20.0,  # no token mask: every candidate token trains
            "d3s/kept_token_frac": 0.4,
            "d3s/adv_var_all": float(advantages.double().var(unbiased=False)),
            "d3s/adv_var_kept": float(advantages[kept].double().var(unbiased=False)),
            "d3s/zero_var_groups": 1.0,
        }
    )
    assert list(metrics)[:4] == ["d3s/n", "d3s/k", "d3s/kept_rollouts", "d3s/kept_rollout_frac"]


def test_with_a_token_mask():
    advantages = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0]])  # (S, A), right-padded
    entropy = torch.tensor([[0.5, 0.0, 1.5, 0.0], [1.0, 2.0, 0.0, 0.0]])
    action_mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    keep = token_keep_mask(advantages, entropy, action_mask, 0.5)
    stats = token_mask_metrics(keep, action_mask, entropy, advantages)
    metrics = step_metrics(2, 0.5, REWARDS, 2, 5, 40, token_stats=stats)
    assert metrics["d3s/scored_tokens"] == 4.0  # the zero-entropy token has no score
    assert metrics["d3s/kept_tokens"] == 3.0 and metrics["d3s/kept_token_frac"] == 3 / 40  # ceil(0.5 * 5)
    assert metrics["d3s/candidate_tokens"] == 5.0
    assert metrics["d3s/entropy_all"] == pytest.approx(5.0 / 5) and metrics["d3s/entropy_kept"] == pytest.approx(1.5)
    assert "d3s/adv_var_all" not in metrics  # no group estimator given


def test_degenerate_steps_stay_finite():
    # one rollout per prompt: no group, so no zero-variance count; no response token at all
    metrics = step_metrics(1, 1.0, torch.ones(2, 1), 2, 0, 0)
    assert metrics["d3s/kept_token_frac"] == 0.0 and "d3s/zero_var_groups" not in metrics
    equal = torch.zeros(4, 5)
    zeros = group_advantages(equal, "group_norm").reshape(-1)
    metrics = step_metrics(2, 1.0, equal, 8, 8, 20, advantages=zeros, kept_advantages=zeros[:8])
    assert metrics["d3s/zero_var_groups"] == 4.0 and metrics["d3s/adv_var_kept"] == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match="B, G"):
        step_metrics(1, 1.0, torch.ones(3), 1, 1, 1)
    with pytest.raises(ValueError, match="both"):
        step_metrics(1, 1.0, REWARDS, 1, 1, 1, advantages=torch.zeros(9))


def gap_by_loop(trainer, engine, mask):
    gaps = [
        abs(float(t) - float(e))
        for t_row, e_row, m_row in zip(trainer, engine, mask)
        for t, e, m in zip(t_row, e_row, m_row)
        if m
    ]
    return sum(gaps) / len(gaps) if gaps else 0.0


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logprob_gap_is_the_token_mean_over_the_generated_tokens(shape, dtype):
    generator = torch.Generator().manual_seed(shape[0] * 10 + shape[1])
    trainer = -torch.rand(shape, generator=generator).to(dtype) * 3
    engine = -torch.rand(shape, generator=generator).to(dtype) * 3
    mask = torch.rand(shape, generator=generator) < 0.6
    mask[0, 0] = True
    expected = gap_by_loop(trainer, engine, mask)
    for action_mask in (mask, mask.long()):
        gap = logprob_gap(trainer, engine, action_mask)
        assert gap.dim() == 0 and gap.dtype == torch.float32
        assert float(gap) == pytest.approx(expected, rel=1e-5)


def test_the_logprob_gap_reads_nothing_outside_the_mask_and_is_zero_without_tokens():
    trainer = torch.tensor([[-1.0, float("nan"), -2.0]])
    engine = torch.tensor([[-1.5, 0.0, float("-inf")]])
    assert float(logprob_gap(trainer, engine, torch.tensor([[1, 0, 0]]))) == pytest.approx(0.5)
    assert float(logprob_gap(trainer, engine, torch.zeros(1, 3, dtype=torch.bool))) == 0.0


def test_the_logprob_gap_refuses_shapes_that_differ():
    with pytest.raises(ValueError, match=r"\(2, 3\), \(2, 4\) and \(2, 3\)"):
        logprob_gap(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
