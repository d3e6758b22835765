"""Unbiased pass@k beside upstream's evaluation metrics, during training.

OpenRLHF's ``compute_eval_metrics`` logs, per datasource, ``eval_<ds>_pass1`` (the mean reward) and
``eval_<ds>_pass{n}`` (the mean of each prompt's best reward: "any of n"), with n = --eval.n_samples_per_prompt.
:func:`compute_eval_metrics` returns those unchanged and adds ``<ds>/pass@k`` for k = 1, 2, 4, ... <= n and n
(``core.pass_at_k.powers_of_two_up_to``): the unbiased estimator of :mod:`d3s_openrlhf.core.pass_at_k`, with its
correctness rule (reward >= 1 - 1e-6), the one ``python -m d3s_openrlhf.cli.evaluate`` reports. The loggers
prefix ``eval/``: ``eval/<ds>/pass@k`` in wandb and tensorboard.

The seams: :class:`PassAtKPPOTrainerBase` (sync trainer, ``evaluate``) and
:class:`PassAtKGenerateSamplesActorBase` (async generator actor, ``_run_eval``) call upstream's method with
:func:`compute_eval_metrics` in place of the module global it calls. The D3S trainers derive from them
(``integration/trainer.py``); with D3S off, the entrypoint swaps in the Ray actors of this module
(``swaps.pass_at_k_swaps``), so a GRPO run logs the same metric. The samples are grouped as upstream groups them (n
consecutive samples per prompt, the datasource of the group's first prompt).

Both seams also build their samples generator from ``samples_generator_class``: upstream's, asking under LoRA for the
engine's log-probs (``integration/engine_gap.py``), or the D3S trainers' own.
"""

from __future__ import annotations

import inspect
from typing import Dict

import numpy as np
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ppo_trainer import compute_eval_metrics as upstream_compute_eval_metrics
from openrlhf.trainer.ppo_trainer_async import GenerateSamplesActor, PPOTrainerAsync

from d3s_openrlhf.core.pass_at_k import is_correct, mean_pass_at_k, powers_of_two_up_to
from d3s_openrlhf.integration.engine_gap import EngineLogprobsSamplesGenerator
from d3s_openrlhf.integration.seams import remote_like, swapped_globals


def pass_at_k_logs(eval_dataloader, samples_list, n_samples_per_prompt: int) -> Dict[str, float]:
    """``{"<ds>/pass@k": value}`` for every datasource of the evaluated samples."""
    if not samples_list:
        return {}
    n = int(n_samples_per_prompt)
    datasource_of = {}
    for datasources, prompts, _labels, _images in eval_dataloader:
        datasource_of.update(zip(prompts, datasources))
    prompts = [prompt for samples in samples_list for prompt in samples.prompts]
    rewards = np.array([float(r) for samples in samples_list for r in np.asarray(samples.rewards).reshape(-1)])
    if len(rewards) % n or len(prompts) != len(rewards):
        raise ValueError(f"{len(rewards)} eval rewards for {len(prompts)} samples: not groups of {n} per prompt")
    correct = is_correct(rewards).reshape(-1, n).sum(axis=1)  # (P,)
    sources = np.array([datasource_of.get(prompts[i * n], "unknown") for i in range(len(correct))])
    logs = {}
    for source in dict.fromkeys(sources.tolist()):
        c = correct[sources == source]
        for k in powers_of_two_up_to(n):
            logs[f"{source}/pass@{k}"] = mean_pass_at_k(np.full(len(c), n), c, k)
    return logs


def compute_eval_metrics(eval_dataloader, samples_list, n_samples_per_prompt):
    """Upstream's metrics, plus the unbiased ``<ds>/pass@k`` (module docstring)."""
    logs = upstream_compute_eval_metrics(eval_dataloader, samples_list, n_samples_per_prompt)
    logs.update(pass_at_k_logs(eval_dataloader, samples_list, n_samples_per_prompt))
    return logs


class PassAtKPPOTrainerBase(PPOTrainer.__ray_actor_class__):
    """Upstream's sync trainer whose evaluation adds the unbiased pass@k, with ``samples_generator_class``."""

    samples_generator_class = EngineLogprobsSamplesGenerator

    def __init__(self, *args, **kwargs):
        # upstream's __init__ calls zero-argument super(), which Ray's by-value copy of it binds to a copy of its
        # class that is not in this MRO: entering through this importable method resolves the imported class
        upstream_init = PPOTrainer.__ray_actor_class__.__init__
        with swapped_globals(upstream_init, SamplesGenerator=self.samples_generator_class):
            super().__init__(*args, **kwargs)

    def evaluate(self, global_step, **generate_kwargs):
        upstream = inspect.unwrap(PPOTrainer.__ray_actor_class__.evaluate)  # it runs under @torch.no_grad()
        with swapped_globals(upstream, compute_eval_metrics=compute_eval_metrics):
            return super().evaluate(global_step, **generate_kwargs)


class PassAtKGenerateSamplesActorBase(GenerateSamplesActor.__ray_actor_class__):
    """Upstream's async generator actor whose evaluation adds the unbiased pass@k, with ``samples_generator_class``."""

    samples_generator_class = EngineLogprobsSamplesGenerator

    def __init__(self, *args, **kwargs):
        upstream_init = GenerateSamplesActor.__ray_actor_class__.__init__
        with swapped_globals(upstream_init, SamplesGenerator=self.samples_generator_class):
            super().__init__(*args, **kwargs)

    def _run_eval(self):
        upstream = inspect.unwrap(GenerateSamplesActor.__ray_actor_class__._run_eval)
        with swapped_globals(upstream, compute_eval_metrics=compute_eval_metrics):
            return super()._run_eval()


PassAtKPPOTrainer = remote_like(PPOTrainer, PassAtKPPOTrainerBase)
PassAtKGenerateSamplesActor = remote_like(GenerateSamplesActor, PassAtKGenerateSamplesActorBase)


class _PassAtKPPOTrainerAsync(PPOTrainerAsync.__ray_actor_class__):
    """Upstream's async trainer with :class:`PassAtKGenerateSamplesActor` as its generator actor."""

    def __init__(self, *args, **kwargs):
        upstream_init = super().__init__
        with swapped_globals(upstream_init.__func__, GenerateSamplesActor=PassAtKGenerateSamplesActor):
            upstream_init(*args, **kwargs)


PassAtKPPOTrainerAsync = remote_like(PPOTrainerAsync, _PassAtKPPOTrainerAsync)
