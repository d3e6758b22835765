"""Real ``train_ppo_ray`` runs of a few steps on the toy model (CPU runtime, vLLM CPU engine, gloo weight sync).

Each test asserts from the metrics OpenRLHF logged that every step kept the number of rollouts and tokens
its (N, K) asks for, that the loss is finite and the gradient non-zero, that the run exited cleanly, and that
no process of the run outlived it.

A run costs about a minute, nearly all of it start-up, so each run covers several things: cross scope with
token selection on one rank, sample packing and a checkpoint resume in the checkpoint test; async mode, the
training-time evaluation and the fork path (upstream's entrypoint patched) in one run; two ranks under ZeRO-3 in
the all-equal-rewards test and in test_e2e_modes.py's dynamic-batching runs (cross, and intra on two nodes);
PODS (intra scope, advantages over the subset) with GSPO in test_e2e_modes.py's chunked-logits run; GSPO from a
launch script in the gspo_d3s smoke run (tests/examples/test_examples_smoke.py). The baseline (D3S off, sync) and
the async run also evaluate on held-out prompts and check the unbiased eval/<datasource>/pass@k beside upstream's
metrics.
"""

import dataclasses
import os

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
    window. The PG term is 0 (not 0/0), the entropy bonus still trains, nothing turns NaN (ZeRO-3, two ranks)."""
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
        extra=d3s_flags(**CROSS) + ["--actor.entropy_coef", "0.01"],
    )
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "equal", config), name="equal")
    assert_clean_run(run, range(1, STEPS + 1))
    assert_kept_counts(run, expected_schedule(CROSS, config, STEPS))
    for step, values in run.steps.items():
        assert values["d3s/scored_tokens"] == 0 and values["d3s/kept_tokens"] == 0, step
        assert values["policy_loss"] == 0.0, step
        assert values["d3s/zero_var_groups"] == PROMPTS, step


def test_checkpoint_resume_continues_schedule_with_packing(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """Run 2 of 4 scheduled steps with a checkpoint, then resume with the data for 4: steps 3-4 follow on. Both
    runs pack samples (--ds.packing_samples forces flash_attention_2: upstream's default attention, served by the
    CPU stand-in)."""
    fields = dict(CROSS, schedule_steps=4)
    packing = ["--ds.packing_samples", "--ds.attn_implementation", "flash_attention_2"]
    checkpoint_flags = packing + ["--ckpt.save_steps", "2", "--ckpt.path", str(tmp_path / "checkpoints")]
    first = dataclasses.replace(BASE, steps=2, extra=d3s_flags(**fields) + checkpoint_flags)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "first", first), name="first")
    assert_clean_run(run, [1, 2])
    assert_kept_counts(run, expected_schedule(fields, first, 4, last_step=2))
    assert os.path.isdir(tmp_path / "checkpoints" / "_actor"), "no actor checkpoint was written"

    resumed = dataclasses.replace(BASE, steps=4, extra=d3s_flags(**fields) + checkpoint_flags + ["--ckpt.load_enable"])
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "resumed", resumed), name="resumed")
    assert_clean_run(run, [3, 4])
    assert_kept_counts(run, expected_schedule(fields, resumed, 4, first_step=3))


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
