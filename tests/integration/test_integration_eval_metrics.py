"""The training-time unbiased pass@k: ``integration.eval_metrics`` against brute force, and the trainers' seams
(sync ``evaluate``, async ``_run_eval``) logging it beside upstream's metrics, with upstream's code running."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer import ppo_trainer, ppo_trainer_async

from d3s_openrlhf.integration import eval_metrics
from d3s_openrlhf.integration.trainer import _D3SGenerateSamplesActor, _D3SPPOTrainer

# the seams alone (what a run with D3S off uses) and under the D3S trainers
SYNC_TRAINERS = [eval_metrics.PassAtKPPOTrainerBase, _D3SPPOTrainer]
ASYNC_GENERATORS = [eval_metrics.PassAtKGenerateSamplesActorBase, _D3SGenerateSamplesActor]

# (datasource, prompt, rewards of its 4 samples); the 0.5 is a partial credit: wrong
GROUPS = [
    ("gsm8k", "p0", [1.0, 0.0, 0.0, 0.0]),
    ("gsm8k", "p1", [1.0, 1.0, 0.0, 1.0]),
    ("math", "p2", [0.0, 0.0, 0.0, 0.0]),
    ("math", "p3", [0.5, 0.0, 1.0, 0.0]),
    ("math", "p4", [0.5, 0.0, 0.0, 0.0]),
]
N = 4


def brute_force(rewards, k):
    subsets = list(itertools.combinations([r >= 1 for r in rewards], k))
    return sum(any(s) for s in subsets) / len(subsets)


def samples_and_loader():
    samples = [
        SimpleNamespace(
            prompts=[prompt], rewards=torch.tensor([r]), response_length=torch.tensor(3.0), truncated=torch.tensor(0.0)
        )
        for _, prompt, rewards in GROUPS
        for r in rewards
    ]
    sources, prompts = [source for source, _, _ in GROUPS], [prompt for _, prompt, _ in GROUPS]
    loader = [(sources, prompts, ["l"] * len(GROUPS), [None] * len(GROUPS))]
    return samples, loader


def expected_pass_at_k():
    expected = {}
    for source in ("gsm8k", "math"):
        groups = [rewards for s, _, rewards in GROUPS if s == source]
        for k in (1, 2, 4):
            expected[f"{source}/pass@{k}"] = sum(brute_force(g, k) for g in groups) / len(groups)
    return expected


def test_pass_at_k_beside_upstream_metrics():
    samples, loader = samples_and_loader()
    logs = eval_metrics.compute_eval_metrics(loader, samples, N)
    upstream = ppo_trainer.compute_eval_metrics(loader, samples, N)
    assert {k: v for k, v in logs.items() if k in upstream} == upstream
    added = {k: v for k, v in logs.items() if k not in upstream}
    assert added == pytest.approx(expected_pass_at_k(), abs=1e-12)
    # pass@n is upstream's "any of n" where rewards are 0/1 (gsm8k), and lower where a partial credit counts wrong
    assert logs["gsm8k/pass@4"] == pytest.approx(upstream["eval_gsm8k_pass4"])
    assert logs["math/pass@4"] == pytest.approx(1 / 3)
    assert upstream["eval_math_pass4"] == pytest.approx(1.5 / 3)


def test_refuses_non_finite_and_ragged_rewards():
    samples, loader = samples_and_loader()
    samples[0].rewards = torch.tensor([float("nan")])
    with pytest.raises(ValueError, match="non-finite reward"):
        eval_metrics.pass_at_k_logs(loader, samples, N)
    with pytest.raises(ValueError, match="not groups of 3"):
        eval_metrics.pass_at_k_logs(loader, samples_and_loader()[0], 3)


class _Recorder:
    def __init__(self):
        self.logged = []

    def log_eval(self, step, logs):
        self.logged.append((step, dict(logs)))


@pytest.mark.parametrize("trainer_class", SYNC_TRAINERS)
def test_sync_trainer_evaluate_logs_pass_at_k(trainer_class):
    samples, loader = samples_and_loader()
    trainer = object.__new__(trainer_class)
    trainer.samples_generator = SimpleNamespace(generate_eval_samples=lambda **kwargs: samples)
    trainer.eval_dataloader = loader
    trainer.wandb_logger = None
    trainer.tensorboard_logger = _Recorder()
    logs = trainer.evaluate(7, n_samples_per_prompt=N)
    assert trainer.tensorboard_logger.logged == [(7, logs)]
    assert {k: logs[k] for k in expected_pass_at_k()} == pytest.approx(expected_pass_at_k())
    assert "eval_gsm8k_pass1" in logs
    assert ppo_trainer.compute_eval_metrics is eval_metrics.upstream_compute_eval_metrics  # restored


@pytest.mark.parametrize("actor_class", ASYNC_GENERATORS)
def test_async_generator_run_eval_logs_pass_at_k(actor_class):
    samples, loader = samples_and_loader()
    actor = object.__new__(actor_class)
    actor.samples_generator = SimpleNamespace(generate_eval_samples=lambda **kwargs: samples)
    actor.eval_dataloader = loader
    actor.generate_kwargs = {"temperature": 1.0}
    actor.args = SimpleNamespace(eval=SimpleNamespace(temperature=0.6, n_samples_per_prompt=N))
    logs = actor._run_eval()
    assert {k: logs[k] for k in expected_pass_at_k()} == pytest.approx(expected_pass_at_k())
    assert "eval_math_pass4" in logs
    assert ppo_trainer_async.compute_eval_metrics is eval_metrics.upstream_compute_eval_metrics  # restored
