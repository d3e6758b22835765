"""Real ``train_ppo_ray`` runs of the modes GPU users switch on for speed, with D3S, on the CPU runtime: dynamic
batching (which packs samples: flash-attention 2 on the CPU stand-in; cross and intra scope), fixed updates
(``--d3s.optimizer_steps``), DAPO-style dynamic filtering, the chunked-logits forwards of PODS with GSPO and the KL
loss, and a multi-turn agent. Same per-step assertions as tests/e2e/test_e2e_pipeline.py."""

import dataclasses
import json
import math
import os
import re
from fractions import Fraction
from pathlib import Path

import pipeline_checks as helpers
import pytest

from d3s_openrlhf.core.batching import kept_unit, legal_kept_count
from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.testbed import pipeline

pytestmark = pytest.mark.e2e

BASE, STEPS = helpers.BASE, helpers.STEPS
CROSS, ppo_args = helpers.CROSS, helpers.ppo_args
TOY_AGENT = str(Path(pipeline.__file__).with_name("toy_agent.py"))


# ── dynamic batching ──

# Loaded by every Python process of the run (Ray workers inherit PYTHONPATH): records, for each training
# micro-batch of the D3S actor under dynamic batching, its kept tokens and sequences, whether it closes an
# optimizer step, and the kept-token normalisers the loss was given.
NORM_PROBE = """
import json, os


def _probe(module):
    trainer = module.D3SActorPPOTrainer
    upstream = trainer.training_step

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        rows = experience.info.get(module.PG_MASK_KEY)
        if rows is not None and self.args.train.dynamic_batch_enable:
            import torch.distributed as dist

            kept = module.pg_mask_from_rows(rows, experience.action_mask)
            buffer = self.replay_buffer
            record = dict(
                kept_tokens=float(kept.sum()),
                kept_seqs=float((kept.sum(-1) > 0).sum()),
                last=bool(buffer.dynamic_optimizer_step[step]),
                norm_tokens=buffer.d3s_pg_batch_num_tokens[step],
                norm_seqs=buffer.d3s_pg_global_batch_size[step],
            )
            path = os.path.join(os.environ["D3S_E2E_NORM_PROBE"], f"rank{dist.get_rank()}.jsonl")
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\\n")
        return upstream(self, experience, kl_ctl, step, loss_batch_info)

    trainer.training_step = training_step


if os.environ.get("D3S_E2E_NORM_PROBE"):
    from d3s_openrlhf.cpu.patches import when_imported

    when_imported("d3s_openrlhf.integration.actor", _probe)
"""


def probe_env(tmp_path):
    probe_dir = tmp_path / "norm_probe"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(NORM_PROBE)
    path = os.pathsep.join(filter(None, [str(probe_dir), os.environ.get("PYTHONPATH")]))
    return probe_dir, {"PYTHONPATH": path, "D3S_E2E_NORM_PROBE": str(probe_dir)}


def optimizer_steps(records):
    steps, current = [], []
    for record in records:
        current.append(record)
        if record["last"]:
            steps.append(current)
            current = []
    assert not current, "a rank's last micro-batch does not close an optimizer step"
    return steps


def assert_normalisers_are_kept_counts(probe_dir, ranks):
    per_rank = []
    for rank in range(ranks):
        with open(probe_dir / f"rank{rank}.jsonl") as f:
            per_rank.append(optimizer_steps([json.loads(line) for line in f]))
    assert len({len(steps) for steps in per_rank}) == 1, [len(steps) for steps in per_rank]
    assert any(len(step) > 1 for steps in per_rank for step in steps), "no optimizer step had several micro-batches"
    for index, step in enumerate(zip(*per_rank)):
        kept_tokens = sum(record["kept_tokens"] for rank_step in step for record in rank_step)
        kept_seqs = sum(record["kept_seqs"] for rank_step in step for record in rank_step)
        assert kept_tokens > 0, index
        for rank_step in step:
            for record in rank_step:
                assert record["norm_tokens"] == kept_tokens, (index, record, kept_tokens)
                assert record["norm_seqs"] == kept_seqs, (index, record, kept_seqs)


INTRA = dict(preset="d3s-i", sample_scope="intra", n_init=3, n_final=6, k_init=0.6, k_final=0.9)
# a reward that differs for every rollout: no group is flat. With dynamic batching upstream does not shuffle the
# replay buffer, so an optimizer window holds the rollouts of a few neighbouring prompts; with the task's exact-match
# reward all of them could be flat (intra selection keeps n of every group), leaving a window without a kept token
# or a gradient by chance (about 1 run in 100)
DISTINCT_REWARD = """
import torch

GENERATOR = torch.Generator().manual_seed(0)

def reward_func(queries, prompts, labels, **kwargs):
    rewards = torch.rand(len(queries), generator=GENERATOR)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
"""


@pytest.mark.parametrize("fields", [CROSS, INTRA], ids=["cross", "intra"])
def test_dynamic_batching_two_ranks_zero3(fields, toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """Two ZeRO-3 ranks under dynamic batching, the kept-token normalisers of every optimizer step checked. (Runs
    that span two Ray nodes: the launch-script smoke run of gspo_d3s, tests/examples/test_examples_smoke.py.)"""
    # dynamic batching forces packing (and flash_attention_2 over the eager default of ppo_args); 48 tokens per
    # micro-batch of sequences up to 16 tokens: several micro-batches per optimizer step
    dynamic = ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "48", "--rollout.max_tokens_per_gpu", "48"]
    reward = tmp_path / "distinct_reward.py"
    reward.write_text(DISTINCT_REWARD)
    config = dataclasses.replace(
        BASE,
        actor_gpus=2,
        zero_stage=3,
        micro_batch_size=8,
        reward=str(reward),
        extra=helpers.d3s_flags(**fields) + dynamic,
    )
    probe_dir, env = probe_env(tmp_path)
    name = f"dynamic_{fields['sample_scope']}"
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, name, config), name=name, env=env)
    assert_clean_run(run, range(1, STEPS + 1))
    # with dynamic batching the kept-count unit is lcm(train batch, DP) = 16, as without it here
    assert kept_unit(16, 8, 2, True) == kept_unit(16, 8, 2, False)
    helpers.assert_kept_counts(run, helpers.expected_schedule(fields, config, STEPS))
    assert_normalisers_are_kept_counts(probe_dir, ranks=2)


# ── fixed updates ──


def test_fixed_updates_takes_the_full_batchs_optimizer_steps(toy_sft, run_pipeline, assert_clean_run, tmp_path, capsys):
    """--d3s.optimizer_steps fixed_updates on two ZeRO-3 ranks, two epochs: as N moves 2 -> 4 -> 6 of 8, every
    rollout step takes the optimizer steps of a full batch, B x G / --train.batch_size = 8 per epoch (DeepSpeed's
    gradient accumulation 1, 2, 3), the count the dry run printed, each on kept / 8 rollouts."""
    from d3s_openrlhf.cli import train_ppo_ray as cli

    fields = dict(CROSS, optimizer_steps="fixed_updates", schedule_steps=STEPS)
    config = dataclasses.replace(
        BASE,
        actor_gpus=2,
        zero_stage=3,
        micro_batch_size=2,
        extra=helpers.d3s_flags(**fields) + ["--train.max_epochs", "2"],
    )
    args = ppo_args(toy_sft, tmp_path, "fixed_updates", config)
    cli.main([*map(str, args), "--d3s.dry_run"])
    planned = {
        int(step): (int(kept), int(updates))
        for step, kept, updates in re.findall(
            r"step +(\d+):  N = +\d+  kept rollouts +(\d+) / \d+ \([\d.]+%\)  optimizer steps (\d+) x",
            capsys.readouterr().out,
        )
    }
    assert planned == {1: (32, 8), 2: (64, 8), 3: (96, 8)}, planned
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, args, name="fixed_updates")
    # the logged norm is the last optimizer step's: at step 1, the second epoch's step on 4 of the 32 kept
    # rollouts, 4 to 8 selected tokens, which PPO's clip (16% of step 1's tokens in a run here) can all zero (CI
    # logged 0.0 once)
    assert_clean_run(run, range(1, STEPS + 1), grad_every_step=False)
    for step, (kept, updates) in planned.items():
        values = run.steps[step]
        assert values["d3s/kept_rollouts"] == kept, (step, values)
        assert values["d3s/optimizer_steps"] == 2 * updates, (step, values)  # two epochs


# ── DAPO-style dynamic filtering ──


def test_dynamic_filtering_trains_the_fixed_steps(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    # groups whose mean reward is outside (0.2, 0.8) are dropped and replaced by further prompts, so a pass over the
    # run's 64 prompts makes fewer than 4 rollout steps; with --d3s.schedule_steps the prompts cycle and the run
    # trains exactly that many steps; step s uses the schedule's point s - 1, with the kept count rounded for the
    # rollouts that step actually has
    fields = dict(CROSS, schedule_steps=3)
    filtering = ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.2", "0.8"]
    # kept counts in units of 8 = one prompt's group
    config = dataclasses.replace(
        BASE, steps=4, train_batch_size=8, micro_batch_size=8, extra=helpers.d3s_flags(**fields) + filtering
    )
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "filtering", config), name="filtering")
    assert_clean_run(run, range(1, 4))
    # the share of the groups generated that passed the filter (upstream's dynamic_filtering_pass_rate is G times
    # its percentage)
    pass_fracs = [values["d3s/filter_pass_frac"] for values in run.steps.values()]
    assert all(0 < frac <= 1 for frac in pass_fracs) and min(pass_fracs) < 1, f"nothing filtered: {pass_fracs}"

    schedule = D3SConfig.from_flags(fields).schedule_for(3)
    unit = kept_unit(config.train_batch_size, config.micro_batch_size, config.actor_gpus, False)
    for step, values in run.steps.items():
        n, k = schedule.at(step - 1)
        total = int(values["rollout/num_samples"])
        assert total == config.prompts_per_step * config.samples_per_prompt, (step, total)  # full: the prompts cycle
        assert total % unit == 0, (step, total)
        kept = legal_kept_count(n * total // config.samples_per_prompt, total, unit)
        assert (values["d3s/n"], values["d3s/kept_rollouts"]) == (n, kept), (step, values, n, kept)
        assert values["d3s/k"] == pytest.approx(k, abs=1e-6), step
        assert 0 < values["d3s/kept_tokens"] <= values["d3s/candidate_tokens"], step


# ── the chunked-logits forwards ──

KL_AND_ENTROPY = ["--algo.kl.use_loss", "--actor.entropy_coef", "0.01"]


PODS = dict(preset="pods", n_init=4, n_final=4)  # intra, max-variance on rewards, advantages over the kept 4 of 8


def test_pods_with_gspo_trains_with_chunked_logits(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """PODS at K = 1 with GSPO and the KL loss, under --d3s.chunked_logits: the training forward scores every action
    token from the hidden states (the actor says so once). D3S at K < 1 with the KL loss: the all-equal-rewards run
    of tests/e2e/test_e2e_pipeline.py."""
    flags = ["--d3s.chunked_logits", "--actor.policy_loss_type", "gspo"] + KL_AND_ENTROPY
    config = dataclasses.replace(BASE, kl_coef=0.01, extra=helpers.d3s_flags(**PODS) + flags)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "every_token", config), name="every_token")
    assert_clean_run(run, range(1, STEPS + 1))
    helpers.assert_kept_counts(run, helpers.expected_schedule(PODS, config, STEPS))
    log = Path(run.log).read_text(errors="replace")
    said = "every action token (--actor.policy_loss_type gspo"
    assert f"[d3s] training forward with chunked logits: log-probs at {said}" in log, run.tail()
    assert "with full logits (" not in log
    for step, values in run.steps.items():
        assert math.isfinite(values["kl"]) and math.isfinite(values["entropy_loss"]), (step, values)


# ── a multi-turn agent ──


def test_multi_turn_agent_cross_scope(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    # two answers per rollout (the question is asked twice), the reward at the end; prompt + 2 x (answer + EOS)
    # + the repeated question fit in 32 tokens
    agent = ["--train.agent_func_path", TOY_AGENT, "--data.max_len", "32"]
    config = dataclasses.replace(BASE, extra=helpers.d3s_flags(**CROSS) + agent)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "agent", config), name="agent")
    assert_clean_run(run, range(1, STEPS + 1))
    for step, values in run.steps.items():
        assert values["agent_turns"] == 2, (step, values.get("agent_turns"))
    # each rollout has two answers: more action tokens than the single-turn bound of assert_kept_counts
    schedule = helpers.expected_schedule(CROSS, config, STEPS)
    for step, (n, k, kept) in schedule.items():
        values = run.steps[step]
        assert (values["d3s/n"], values["d3s/kept_rollouts"]) == (n, kept), (step, values)
        candidates = values["d3s/candidate_tokens"]
        assert 2 * kept <= candidates, (step, candidates)  # at least one token per answer
        budget = max(1, math.ceil(Fraction(k).limit_denominator(10**6) * int(candidates)))
        kept_tokens = min(budget, values["d3s/scored_tokens"])  # zero-score tokens are never kept
        assert values["d3s/kept_tokens"] == kept_tokens, (step, values["d3s/kept_tokens"], kept_tokens)
