"""Unbiased pass@k beside upstream's evaluation metrics, during training.

OpenRLHF's ``compute_eval_metrics`` logs, per datasource, ``eval_<ds>_pass1`` (the mean reward) and
``eval_<ds>_pass{n}`` (the mean of each prompt's best reward: "any of n"), with n = --eval.n_samples_per_prompt.
:func:`compute_eval_metrics` returns those unchanged and adds ``<ds>/pass@k`` for k = 1, 2, 4, ... <= n and n
(``core.pass_at_k.powers_of_two_up_to``): the unbiased estimator of :mod:`d3s_openrlhf.core.pass_at_k`, with its
correctness rule (reward >= 1 - 1e-6), the one ``python -m d3s_openrlhf.cli.evaluate`` reports. The loggers
prefix ``eval/``: ``eval/<ds>/pass@k`` in wandb and tensorboard.

The trainers swap it in for the module global their ``evaluate`` (sync) or ``_run_eval`` (async generator actor)
calls (``integration/trainer.py``); the samples are grouped as upstream groups them (n consecutive samples per
prompt, the datasource of the group's first prompt).
"""

from __future__ import annotations

from typing import Dict

import numpy as np
from openrlhf.trainer.ppo_trainer import compute_eval_metrics as upstream_compute_eval_metrics

from d3s_openrlhf.core.pass_at_k import is_correct, mean_pass_at_k, powers_of_two_up_to


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
