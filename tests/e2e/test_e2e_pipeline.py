"""Real ``train_ppo_ray`` runs of a few steps on the toy model (CPU runtime, vLLM CPU engine, gloo weight sync).

Each test asserts from the metrics OpenRLHF logged that every step kept the number of rollouts and tokens
its (N, K) asks for, that the loss is finite and the gradient non-zero, that the run exited cleanly, and that
no process of the run outlived it.

A run costs about a minute, nearly all of it start-up, so each run covers several things: async mode, the
training-time evaluation and the fork path (upstream's entrypoint patched) in one run; sample packing and a
checkpoint resume that continues the schedule in tests/e2e/test_e2e_dead_actor.py (after a killed engine); two
ranks under ZeRO-3 in the all-equal-rewards test (with the KL loss: chunked logits at every action token) and in
test_e2e_modes.py's dynamic-batching runs (cross and intra);
PODS (intra scope, advantages over the subset) with GSPO in test_e2e_modes.py's chunked-logits run; GSPO from a
launch script in the gspo_d3s smoke run (tests/examples/test_examples_smoke.py). The baseline (D3S off, sync) and
the async run also evaluate on held-out prompts and check the unbiased eval/<datasource>/pass@k beside upstream's
metrics.
"""

import dataclasses
import math
from pathlib import Path

import pytest
from pipeline_checks import (
    BASE,
    CROSS,
    GROUP,
    PROMPTS,
    STEPS,
    assert_kept_counts,
    assert_pass_at_k_logged,
    d3s_flags,
    eval_flags,
    expected_schedule,
    patched_upstream_env,
    ppo_args,
)

from d3s_openrlhf.testbed import pipeline

pytestmark = pytest.mark.e2e


def test_baseline_d3s_off(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    # through the opt-in environment variable instead of the launcher: the entrypoint activates the runtime; with
    # the training-time evaluation (sync trainer)
    config = dataclasses.replace(BASE, extra=eval_flags(toy_sft))
    args = ppo_args(toy_sft, tmp_path, "baseline", config)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, args, name="baseline", env_flag=True)
    assert_clean_run(run, range(1, STEPS + 1))
    for step, values in run.steps.items():
        assert values["rollout/num_samples"] == PROMPTS * GROUP, step
        assert not [key for key in values if key.startswith("d3s/")], f"D3S metrics with D3S off at step {step}"
    assert_pass_at_k_logged(tmp_path, "baseline")


def test_all_equal_rewards_on_two_ranks_keep_the_loss_finite(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """Every reward of every batch equal: no advantage, no token with a score, no kept token in any optimizer-step
    window. The PG term is 0 (not 0/0), the entropy bonus and the KL loss still train, nothing turns NaN (ZeRO-3,
    two ranks). The paper-scale scripts' loss (KL loss, K < 1): the training forward scores every action token from
    the hidden states (the actor says so once)."""
    reward = tmp_path / "constant_reward.py"
    reward.write_text(
        "import torch\n\n"
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    rewards = torch.ones(len(queries))\n"
        "    return {'rewards': rewards, 'scores': rewards, 'extra_logs': {}}\n"
    )
    config = dataclasses.replace(
        BASE,
        actor_gpus=2,
        zero_stage=3,
        micro_batch_size=8,
        reward=str(reward),
        kl_coef=0.01,
        extra=d3s_flags(**CROSS) + ["--algo.kl.use_loss", "--actor.entropy_coef", "0.01"],
    )
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "equal", config), name="equal")
    assert_clean_run(run, range(1, STEPS + 1))
    assert_kept_counts(run, expected_schedule(CROSS, config, STEPS))
    for step, values in run.steps.items():
        assert values["d3s/scored_tokens"] == 0 and values["d3s/kept_tokens"] == 0, step
        assert values["policy_loss"] == 0.0, step
        assert values["d3s/zero_var_groups"] == PROMPTS, step
        assert math.isfinite(values["kl"]) and math.isfinite(values["entropy_loss"]), (step, values)
    log = Path(run.log).read_text(errors="replace")
    assert "[d3s] training forward with chunked logits: log-probs at every action token (--algo.kl.use_loss" in log
    assert "with full logits (" not in log


def test_async_mode_through_the_patched_upstream_entrypoint(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """The fork path: OpenRLHF's own ``python -m openrlhf.cli.train_ppo_ray --d3s.*`` from a patched copy, in async
    mode (generation overlaps training; selection, token mask and schedule run in the training actor), with the
    training-time evaluation (the async generator actor)."""
    env = patched_upstream_env(tmp_path)
    config = dataclasses.replace(BASE, extra=d3s_flags(**CROSS) + ["--train.async_enable"] + eval_flags(toy_sft))
    args = ppo_args(toy_sft, tmp_path, "async", config)
    run = run_pipeline("openrlhf.cli.train_ppo_ray", args, name="async", env_flag=True, env=env)
    assert_clean_run(run, range(1, STEPS + 1))
    assert_kept_counts(run, expected_schedule(CROSS, config, STEPS))  # unpatched, upstream rejects --d3s.*
    assert_pass_at_k_logged(tmp_path, "async")
