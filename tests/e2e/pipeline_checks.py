"""What the end-to-end runs share: the toy run's sizes (``BASE``), the D3S flags, and the per-step checks of the
kept counts and of the training-time evaluation. Imported by name (``import pipeline_checks``): tests/e2e/conftest.py
puts this directory on the path, tests/ being no package (OpenRLHF's wheel installs a top-level ``tests``)."""

import math
import os
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import openrlhf
import pytest

from d3s_openrlhf.core.batching import kept_unit, legal_kept_count
from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration.engine_gap import ENGINE_GAP
from d3s_openrlhf.testbed import pipeline
from d3s_openrlhf.testbed.metrics import read_scalars

REPO = Path(__file__).resolve().parents[2]

PROMPTS = 16
GROUP = 8
STEPS = 3
# cross scope with token selection, the mode most runs add to what they test
CROSS = dict(preset="d3s", sample_scope="cross", n_init=2, n_final=6, k_init=0.5, k_final=0.9)
BASE = pipeline.RLConfig(
    prompts_per_step=PROMPTS, samples_per_prompt=GROUP, steps=STEPS, train_batch_size=16, micro_batch_size=16
)
ENGINE_GAP_BOUND = 0.05  # measured 0.0045 to 0.0081 per token in the three LoRA runs (2026-11-29, this VM)


def d3s_flags(**fields):
    flags = []
    for name, value in fields.items():
        flags += [f"--d3s.{name}", str(value)]
    return flags


def expected_schedule(fields, config, run_steps, first_step=1, last_step=None):
    """{global step: (N, K, kept rollouts)} for a run configured with ``--d3s.<fields>`` and ``config``."""
    d3s = D3SConfig.from_flags(fields)
    schedule = d3s.schedule_for(run_steps)
    dp = config.actor_gpus
    unit = kept_unit(config.train_batch_size, config.micro_batch_size, dp, False)
    total = config.prompts_per_step * config.samples_per_prompt
    expected = {}
    for step in range(first_step, (last_step or run_steps) + 1):
        n, k = schedule.at(step - 1)  # OpenRLHF logs step s after train_step(global_step = s - 1)
        kept = legal_kept_count(n * config.prompts_per_step, total, unit) if d3s.samples_enabled else total
        expected[step] = (n, k, kept)
    return expected


def assert_engine_gap_logged(run):
    """Under LoRA every step logs the engine's gap to the trainer on its rollouts, finite and under ENGINE_GAP_BOUND:
    the engine samples the policy that trains."""
    gaps = {step: values.get(ENGINE_GAP) for step, values in run.steps.items()}
    assert gaps and all(gap is not None and 0 <= gap < ENGINE_GAP_BOUND for gap in gaps.values()), gaps


def assert_kept_counts(run, expected):
    for step, (n, k, kept) in expected.items():
        values = run.steps[step]
        assert values["d3s/n"] == n, (step, values["d3s/n"], n)
        assert values["d3s/k"] == pytest.approx(k, abs=1e-6), (step, values["d3s/k"], k)
        assert values["d3s/kept_rollouts"] == kept, (step, values["d3s/kept_rollouts"], kept)
        assert values["d3s/kept_rollout_frac"] == pytest.approx(kept / (PROMPTS * GROUP)), step
        assert "d3s/candidate_tokens" in values, (
            "the experience maker must log d3s/candidate_tokens (response tokens of the kept rollouts)"
        )
        candidates = values["d3s/candidate_tokens"]
        assert kept <= candidates <= kept * 4, (step, candidates)  # 1 to max_new_tokens tokens per rollout
        if k < 1:
            # token_keep_mask's count: ceil(K * n), K read as the nearest fraction with denominator <= 10**6, but
            # never a token whose score |A| * H is 0
            budget = max(1, math.ceil(Fraction(k).limit_denominator(10**6) * int(candidates)))
            kept_tokens = min(budget, values["d3s/scored_tokens"])
        else:
            kept_tokens = candidates
        assert values["d3s/kept_tokens"] == kept_tokens, (step, values["d3s/kept_tokens"], kept_tokens)


def ppo_args(toy_sft, tmp_path, name, config):
    return pipeline.ppo_args(toy_sft.sft_model, toy_sft.task, str(tmp_path / name), config)


def eval_flags(toy_sft, n=4):
    """OpenRLHF's evaluation at step 2 (async: before the last batch is generated), on the held-out prompts (no
    best-checkpoint saving)."""
    return [
        *("--eval.dataset", toy_sft.task.heldout),
        *("--eval.steps", 2),
        *("--eval.n_samples_per_prompt", n),
        *("--eval.temperature", 1.0),
        *("--ckpt.best_metric_key", "none"),
    ]


def assert_pass_at_k_logged(tmp_path, name, n=4):
    """The training-time evaluation logged upstream's metrics and the unbiased eval/<datasource>/pass@k."""
    logged = read_scalars(str(tmp_path / name / "tensorboard"), "eval/")
    assert list(logged) == [2], logged
    values = logged[2]
    passes = [values[f"default/pass@{k}"] for k in (1, 2, 4)]
    assert "eval_default_pass1" in values and "eval_default_pass4" in values, sorted(values)
    assert 0.0 <= passes[0] <= passes[1] <= passes[2] <= 1.0, passes
    # the addition reward is 0/1: pass@1 is upstream's mean reward, pass@n upstream's "any of n"
    assert passes[0] == pytest.approx(values["eval_default_pass1"], abs=1e-5)
    assert passes[2] == pytest.approx(values[f"eval_default_pass{n}"], abs=1e-5)


def patched_upstream_env(tmp_path):
    """The environment of a run through OpenRLHF's own entrypoint patched by ``patches/apply.sh`` (the fork path):
    a patched copy of the installed openrlhf first on ``PYTHONPATH``, which the Ray head and its workers inherit."""
    fork = tmp_path / "fork"
    shutil.copytree(Path(openrlhf.__file__).parent, fork / "openrlhf", ignore=shutil.ignore_patterns("*.pyc"))
    applied = subprocess.run(["bash", str(REPO / "patches" / "apply.sh"), str(fork)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    return {"PYTHONPATH": os.pathsep.join([str(fork), str(REPO)])}
