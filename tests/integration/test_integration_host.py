"""The host seam (``d3s_openrlhf.integration.host``): OpenRLHF's arguments read in one place: the config's
travel form, model-group sizes and GPU demand, the kept-count unit and counts (one rule for training, the LR
horizon and the dry run), the loss terms that need every token, and upstream's ``__main__`` entered without Ray.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration import host
from d3s_openrlhf.integration.host import (
    config_from_args,
    kept_count_unit,
    kept_rollout_count,
    rollout_steps,
    scaled_max_steps,
)

# ── the config in the host args ──


def test_d3s_config_is_read_from_a_config_dict_or_namespace():
    cfg = D3SConfig.from_flags({"preset": "d3s"})
    assert config_from_args(SimpleNamespace(d3s=cfg)) is cfg
    assert config_from_args(SimpleNamespace(d3s=cfg.to_dict())) == cfg
    assert config_from_args(SimpleNamespace(d3s=SimpleNamespace(**cfg.to_dict()))) == cfg
    assert config_from_args(SimpleNamespace()) is None
    assert config_from_args(SimpleNamespace(d3s=None)) is None
    with pytest.raises(ValueError, match="k_init"):
        config_from_args(SimpleNamespace(d3s={**cfg.to_dict(), "k_init": 0.0}))


# ── kept counts ──


def test_kept_count_rounding_rule():
    assert kept_rollout_count(2, 4, 8, 6) == 32  # a batch of 32 is no multiple of 6 (partial batch): kept whole
    assert kept_rollout_count(2, 3, 4, 4) == 8  # 6 -> 8
    assert kept_rollout_count(1, 3, 4, 4) == 4  # 3 -> 4
    assert kept_rollout_count(4, 3, 4, 4) == 12
    assert kept_rollout_count(9, 3, 4, 4) == 12  # N above G keeps everything
    assert kept_rollout_count(1, 1, 4, 8) == 4  # a partial last batch smaller than the unit is kept whole


# ── the LR-scheduler horizon (get_max_steps) ──


def horizon_args(**overrides):
    args = SimpleNamespace(
        rollout=SimpleNamespace(batch_size=4, n_samples_per_prompt=8, micro_batch_size=1),
        train=SimpleNamespace(batch_size=8, max_epochs=2, dynamic_batch_enable=False),
        actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=2),
        ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
        algo=SimpleNamespace(kl=SimpleNamespace(init_coef=0.0), dynamic_filtering_enable=False),
        ref=SimpleNamespace(num_nodes=1, num_gpus_per_node=1),
        critic=SimpleNamespace(model_name_or_path=None, num_nodes=1, num_gpus_per_node=1),
    )
    for key, value in overrides.items():
        *path, name = key.split("__")
        target = args
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    return args


def test_max_steps_is_the_optimizer_steps_of_the_kept_rollouts():
    args = horizon_args()
    # upstream: 4 rollout steps x (4 prompts x 8 samples / 8 per optimizer step) x 2 epochs
    max_steps = 4 * (4 * 8 // 8) * 2
    cfg = D3SConfig(sample_rule="max_var", n_init=2, n_final=6, schedule="linear")
    # N over the 4 steps (p = 0, 1/3, 2/3, 1): 2, 3, 5, 6 -> N * B = 8, 12, 20, 24 -> multiples of lcm(8, 1 * 2) = 8:
    # 8, 16, 24, 24; 2 epochs x (8 + 16 + 24 + 24) / 8 = 18 optimizer steps
    assert scaled_max_steps(args, cfg, max_steps, 4) == 18
    # the exact step count matters: 10 prompts, B = 4, 3 episodes = 9 rollout steps (partial batches included),
    # while upstream's horizon floor(10 * 8 / 8) * 3 * 2 = 60 corresponds to 7.5 full ones
    schedule = cfg.schedule_for(9)
    kept = [max(8, -(-schedule.at(step)[0] * 4 // 8) * 8) for step in range(9)]
    assert scaled_max_steps(args, cfg, 60, 9) == min(60, 2 * sum(kept) // 8)


def test_max_steps_uses_schedule_steps_and_the_dynamic_batch_unit():
    args = horizon_args(train__dynamic_batch_enable=True, actor__num_gpus_per_node=4)
    max_steps = 4 * 4 * 2
    # schedule over 2 steps: N = 2, 6, then 6, 6 (p clipped at 1); unit lcm(8, 4) = 8: 8, 24, 24, 24
    cfg = D3SConfig(sample_rule="max_var", n_init=2, n_final=6, schedule="linear", schedule_steps=2)
    assert scaled_max_steps(args, cfg, max_steps, 4) == 2 * (8 + 24 + 24 + 24) // 8


def test_max_steps_with_a_constant_fraction_and_without_sample_selection():
    args = horizon_args(rollout__n_samples_per_prompt=16, train__batch_size=16)
    max_steps = 10 * (4 * 16 // 16) * 2
    pods = D3SConfig.from_flags({"preset": "pods", "n_init": 4, "n_final": 4})  # keeps 4 of 16 = 1/4 each step
    assert scaled_max_steps(args, pods, max_steps, 10) == max_steps // 4
    tokens_only = D3SConfig(sample_rule="none", k_init=0.1, k_final=0.3)
    assert scaled_max_steps(args, tokens_only, max_steps, 10) == max_steps
    # never above upstream's horizon, and 0 stays 0
    assert scaled_max_steps(args, pods, 1, 10) == 1
    assert scaled_max_steps(args, pods, 0, 10) == 0


def test_max_steps_with_dynamic_filtering_spans_the_schedule_steps():
    args = horizon_args(algo__dynamic_filtering_enable=True)
    # upstream's horizon over-counts under filtering (10 steps estimated); the schedule is set to span 3
    max_steps = 10 * (4 * 8 // 8) * 2
    cfg = D3SConfig(sample_rule="max_var", n_init=2, n_final=6, schedule="linear", schedule_steps=3)
    schedule = cfg.schedule_for(3)
    kept = [-(-schedule.at(step)[0] * 4 // 8) * 8 for step in range(3)]
    assert scaled_max_steps(args, cfg, max_steps, 10) == 2 * sum(kept) // 8
    # token selection alone: the same 3 steps of all B * G rollouts
    tokens_only = D3SConfig(sample_rule="none", k_init=0.1, k_final=0.3, schedule_steps=3)
    assert scaled_max_steps(args, tokens_only, max_steps, 10) == 3 * (4 * 8 // 8) * 2
    # without schedule_steps upstream's estimate stays (the CLI refuses a moving schedule then)
    assert scaled_max_steps(args, D3SConfig(sample_rule="none", k_init=0.1, k_final=0.3), max_steps, 10) == max_steps


def test_kept_count_unit_counts_every_group_that_runs_forwards_on_the_kept_rollouts():
    # actor 2 ranks, micro-batch 1, train batch 8: lcm(8, 1 x 2) = 8
    assert kept_count_unit(horizon_args(), D3SConfig()) == 8
    # a reference model on 3 ranks: kept / 1 micro-batches must split over 2 and 3 ranks: lcm(8, 6) = 24
    args = horizon_args(algo__kl__init_coef=0.01, ref__num_gpus_per_node=3)
    assert kept_count_unit(args, D3SConfig()) == 24
    # a critic on 4 ranks and micro-batches of 2: lcm(8, 2 x lcm(2, 4)) = 8
    args = horizon_args(critic__model_name_or_path="critic", critic__num_gpus_per_node=4, rollout__micro_batch_size=2)
    assert kept_count_unit(args, D3SConfig()) == 8
    # with a KL coefficient of 0 the reference model does not exist
    assert kept_count_unit(horizon_args(ref__num_gpus_per_node=3), D3SConfig()) == 8


def test_fixed_updates_unit_lr_horizon_and_refusals():
    fixed = D3SConfig(sample_rule="max_var", n_init=2, n_final=6, optimizer_steps="fixed_updates")
    # B x G = 32, train batch 8: U = 4 updates; 2 ranks, micro-batch 1: each optimizer batch a multiple of 2
    args = horizon_args(train__micro_batch_size=1)
    assert host.fixed_updates_count(args) == 4
    assert kept_count_unit(args, fixed) == 8  # lcm(4 x 1 x 2, rollout micro 1 x 2)
    args = horizon_args(train__micro_batch_size=2)
    assert kept_count_unit(args, fixed) == 16  # U 4 x micro 2 x dp 2: coarser than the train batch of 8
    assert host.fixed_updates_batch(args, fixed, 16) == 4 and host.fixed_updates_batch(args, fixed, 32) == 8
    assert host.fixed_updates_batch(args, fixed, 20) is None  # a partial batch kept whole: trained as upstream's
    assert host.fixed_updates_batch(args, D3SConfig(sample_rule="max_var"), 16) is None  # fixed batches
    # every rollout step takes the updates of a full batch: upstream's horizon, or epochs x S x U at fixed steps
    assert scaled_max_steps(args, fixed, 40, 4) == 40
    at_fixed_steps = dataclasses.replace(fixed, schedule_steps=3)
    filtering = horizon_args(train__micro_batch_size=2, algo__dynamic_filtering_enable=True)
    assert scaled_max_steps(filtering, at_fixed_steps, 10, 10) == 2 * 3 * 4


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--rollout.batch_size", "3", "--train.batch_size", "16"], "is not a multiple of --train.batch_size 16"),
        (["--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "2"], "--ds.ring_attn_size 2"),
        (["--ds.adam_offload", "--ds.zero_stage", "2"], "--ds.adam_offload at --ds.zero_stage 2"),
    ],
    ids=["partial-updates", "ring-attention", "offloaded-zero2"],
)
def test_fixed_updates_refuses_what_it_cannot_run(flags, fragment):
    base = ["--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "8", "--train.batch_size", "8"]
    base += ["--train.micro_batch_size", "2", "--rollout.micro_batch_size", "2", "--reward.remote_url", "r.py"]
    base += ["--algo.advantage.estimator", "group_norm", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0"]
    args = host.parse_host_args(base + flags)  # argparse: the later flag wins
    config = D3SConfig.from_flags({"preset": "d3s", "n_init": 2, "n_final": 6, "optimizer_steps": "fixed_updates"})
    with pytest.raises(host.D3SValidationError, match=re.escape(fragment)):
        host.validate_against_host(config, args)
    fixed_batch = dataclasses.replace(config, optimizer_steps="fixed_batch")
    assert not [problem for problem in host.host_problems(fixed_batch, args) if "fixed_updates" in problem]


def test_the_dry_run_plans_the_optimizer_steps_of_each_mode():
    flags = ["--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "16", "--rollout.micro_batch_size", "8"]
    flags += ["--train.batch_size", "32", "--train.micro_batch_size", "8", "--actor.num_gpus_per_node", "1"]
    args = host.parse_host_args([*flags, "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0"])
    for mode, expected in (("fixed_batch", {4: 1, 8: 2, 12: 3}), ("fixed_updates", {4: 4, 8: 4, 12: 4})):
        config = D3SConfig.from_flags({"preset": "d3s", "n_init": 4, "n_final": 12, "optimizer_steps": mode})
        plan = host.validate_against_host(config, args)
        assert {n: plan.updates_by_n[n] for n in expected} == expected, mode
        assert {n: plan.kept_by_n[n] for n in expected} == {4: 32, 8: 64, 12: 96}, mode


def test_rollout_steps_horizon():
    args = horizon_args(rollout__batch_size=4, train__num_episodes=2)
    assert rollout_steps(10, args) == 6  # ceil(10 / 4) batches per episode, 2 episodes
    assert rollout_steps(8, args) == 4


def test_the_dry_run_plans_the_kept_counts_training_uses():
    flags = ["--rollout.batch_size", "6", "--rollout.n_samples_per_prompt", "8", "--rollout.micro_batch_size", "2"]
    flags += ["--train.batch_size", "12", "--actor.num_gpus_per_node", "2", "--algo.kl.init_coef", "0"]
    args = host.parse_host_args([*flags, "--algo.advantage.estimator", "group_norm", "--reward.remote_url", "r.py"])
    config = D3SConfig.from_flags({"preset": "d3s", "n_init": 1, "n_final": 8})
    plan = host.validate_against_host(config, args)
    unit = kept_count_unit(args, config)
    assert plan.unit == unit == 12
    assert dict(plan.kept_by_n) == {n: kept_rollout_count(n, 6, 8, unit) for n in range(1, 9)}
    assert plan.kept_by_n[1] == 12 and plan.kept_by_n[8] == 48


# ── model groups ──

GROUPS = [
    *("--actor.num_gpus_per_node", "2"),
    *("--reward.remote_url", "reward.py"),
    *("--algo.kl.init_coef", "0.01"),
]


def test_gpu_demand_counts_the_groups_upstream_places():
    flags = [*GROUPS, "--ref.num_gpus_per_node", "2"]
    assert host.gpu_demand(host.parse_host_args([*flags, "--vllm.num_engines", "2"])) == {
        "actor": 2,
        "ref": 2,
        "vllm": 2,
    }
    # the reward model, and no reference model without a KL term; upstream's default reward group is 8 GPUs
    args = host.parse_host_args(["--actor.num_gpus_per_node", "2", "--algo.kl.init_coef", "0"])
    assert host.gpu_demand(args) == {"actor": 2, "reward": 8}
    assert host.gpu_demand(host.parse_host_args([*flags, "--train.colocate_actor_ref"])) is None


def test_data_parallel_sizes_share_ring_and_tensor_parallel_ranks():
    args = host.parse_host_args([*GROUPS, "--actor.num_nodes", "2", "--actor.num_gpus_per_node", "4"])
    assert host.group_gpus(args, "actor") == 8 and host.data_parallel_size(args) == 8
    args.ds.ring_attn_size, args.ds.tensor_parallel_size = 2, 2
    assert host.data_parallel_size(args) == 2
    assert host.kept_forward_groups(args) == {"actor": 2, "ref": 2}  # upstream's default ref group: 8 GPUs


# ── the loss ──


@pytest.mark.parametrize(
    "flags, needs",
    [
        ([], None),
        (["--actor.policy_loss_type", "gspo"], "--actor.policy_loss_type gspo"),
        (["--algo.kl.use_loss"], "--algo.kl.use_loss"),
        (["--actor.entropy_coef", "0.01"], "--actor.entropy_coef"),
    ],
)
def test_loss_terms_that_read_every_token(flags, needs):
    reason = host.loss_needs_every_token(host.parse_host_args(flags))
    assert reason is None if needs is None else reason.startswith(needs)


# ── upstream's __main__ ──


def test_upstream_train_args_fill_in_upstreams_derived_values_without_ray():
    import ray

    flags = ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2"]
    flags += ["--reward.remote_url", "r.py", "--vllm.num_engines", "1"]
    args = host.upstream_train_args([*flags, "--train.dynamic_batch_enable"])
    assert args.ds.packing_samples and args.ds.attn_implementation == "flash_attention_2"
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match="rejects these flags"):
        host.upstream_train_args([*flags, "--train.partial_rollout_enable"])


def test_split_d3s_flags():
    given, host_argv = host.split_d3s_flags(["--d3s.preset", "d3s", "--train.batch_size", "8"])
    assert given == {"d3s.preset": "d3s"} and host_argv == ["--train.batch_size", "8"]
    with pytest.raises(host.D3SValidationError, match="--d3s.nope"):
        host.split_d3s_flags(["--d3s.nope", "1"])


# ── DeepCompile ──


def test_deepcompile_is_said_once_at_launch_where_tokens_are_selected():
    def notes(*flags, **d3s):
        config = D3SConfig.from_flags({"preset": "d3s", "n_init": 2, "n_final": 8, **d3s})
        return host.validate_against_host(config, host.parse_host_args([*SKIP_HOST, *flags])).notes

    assert not [note for note in notes() if "deepcompile" in note]
    (note,) = [note for note in notes("--ds.deepcompile") if "deepcompile" in note]
    assert "full logits" in note
    assert not [note for note in notes("--ds.deepcompile", k_init=1.0, k_final=1.0) if "deepcompile" in note]
    # without sample selection too: token selection alone, or --d3s.chunked_logits alone
    alone = {"preset": "grpo", "k_init": 0.5, "k_final": 0.5}, {"preset": "grpo", "chunked_logits": True}
    for fields in alone:
        plan = host.validate_against_host(
            D3SConfig.from_flags(fields), host.parse_host_args([*SKIP_HOST, "--ds.deepcompile"])
        )
        assert [note for note in plan.notes if "deepcompile" in note], fields


# ── prompt skipping (the run's steps are then unknown in advance) ──

SKIP_HOST = ["--algo.advantage.estimator", "group_norm", "--rollout.batch_size", "8"]
SKIP_HOST += ["--rollout.n_samples_per_prompt", "8", "--train.batch_size", "16", "--algo.kl.init_coef", "0"]


def skip_problems(*flags, **d3s):
    config = D3SConfig.from_flags({"preset": "grpo", "prompt_skip": "history", "schedule_steps": 20, **d3s})
    try:
        host.validate_against_host(config, host.parse_host_args([*SKIP_HOST, *flags]))
    except host.D3SValidationError as error:
        return str(error)
    return ""


def test_the_generation_level_is_refused_where_it_cannot_learn_before_ray():
    assert skip_problems("--reward.remote_url", "r.py") == ""
    assert skip_problems("--train.agent_func_path", "agent.py") == ""
    assert "give rewards at generation time" in skip_problems("--reward.model_name_or_path", "rm")


def test_skipping_needs_groups():
    one = skip_problems("--reward.remote_url", "r.py", "--rollout.n_samples_per_prompt", "1")
    assert "--rollout.n_samples_per_prompt is 1" in one


@pytest.mark.parametrize("preset", ["grpo", "pods", "d3s"])
def test_skipping_trains_the_fixed_steps_and_the_lr_horizon_follows(preset):
    moving = dict(n_init=2, n_final=8) if preset == "d3s" else {}
    config = D3SConfig.from_flags({"preset": preset, "schedule_steps": 30, **moving, "prompt_skip": "history"})
    args = horizon_args()
    args.d3s = host.config_namespace(config)
    for filtering in (False, True):
        args.algo.dynamic_filtering_enable = filtering
        assert host.steps_unknown_in_advance(args, config) is None  # the steps are the fixed ones
        assert host.rollout_steps(12, args) == 30  # whatever the data and the episodes
    schedule = config.schedule_for(30)
    unit = host.kept_count_unit(args, config)
    kept = [host.kept_rollout_count(schedule.at(step)[0], 4, 8, unit) for step in range(30)]
    if not config.samples_enabled:
        kept = [4 * 8] * 30
    # the LR horizon spans the 30 steps, beyond upstream's count of its passes (10) when the data cycles
    assert scaled_max_steps(args, config, 10, 10) == 2 * sum(kept) // 8


def test_dynamic_filtering_with_schedule_steps_trains_the_fixed_steps():
    config = D3SConfig.from_flags({"preset": "grpo", "chunked_logits": True, "schedule_steps": 30})
    args = horizon_args(algo__dynamic_filtering_enable=True, train__num_episodes=2)
    args.d3s = host.config_namespace(config)
    assert host.fixed_steps(config, args) == 30  # GRESO's baseline: the same steps as the skipping arms
    assert host.steps_unknown_in_advance(args, config) is None
    assert host.rollout_steps(12, args) == 30
    args.algo.dynamic_filtering_enable = False
    assert host.fixed_steps(config, args) is None  # alone, --d3s.schedule_steps is only the schedule's horizon
    assert host.rollout_steps(12, args) == 3 * 2  # ceil(12 / 4) batches per episode, 2 episodes


def test_dynamic_filtering_alone_with_a_moving_schedule_needs_schedule_steps():
    config = D3SConfig.from_flags({"preset": "d3s", "n_init": 2, "n_final": 8})
    args = horizon_args(algo__dynamic_filtering_enable=True)
    assert host.steps_unknown_in_advance(args, config) == "--algo.dynamic_filtering_enable"


# ── DeepSpeed ──


@pytest.mark.parametrize("installed", ["0.18.3", "0.19.6", "0.19.10+cuda", "0.19"])
def test_supported_deepspeed_versions_pass(monkeypatch, installed):
    monkeypatch.setattr(host.metadata, "version", lambda name: installed if name == "deepspeed" else "0")
    assert host.deepspeed_problem(host.installed_deepspeed()) is None
    config = D3SConfig.from_flags({"preset": "grpo", "k_init": 0.5, "k_final": 0.5})
    host.validate_against_host(config, host.parse_host_args(SKIP_HOST))


@pytest.mark.parametrize("installed", ["0.18.2", "0.17.6", "0.20.0", "1.0.0", "dev", None])
def test_other_deepspeed_versions_are_refused_before_ray_with_what_to_install(monkeypatch, installed):
    def version(name):
        if installed is None:
            raise host.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(host.metadata, "version", version)
    config = D3SConfig.from_flags({"preset": "grpo", "k_init": 0.5, "k_final": 0.5})
    with pytest.raises(host.D3SValidationError, match=r"pip install deepspeed==0\.19\.6") as error:
        host.validate_against_host(config, host.parse_host_args(SKIP_HOST))
    assert ("not installed" if installed is None else f"deepspeed {installed} is installed") in str(error.value)
    assert "deepspeed>=0.18.3,<0.20" in str(error.value)


# ── the checks against the host flags: one refusal each, all reported at once ──

REMOTE = ["--reward.remote_url", "r.py"]
D3S_MOVING = {"preset": "d3s", "n_init": 2, "n_final": 8}
SKIPPING = {"preset": "grpo", "prompt_skip": "history", "schedule_steps": 20}


def by_group(check, group):
    (partial,) = [c for c in host.HOST_CHECKS if getattr(c, "func", None) is check and c.keywords["group"] == group]
    return partial


# (check, D3S options, flags it refuses, flags it lets pass, what the refusal says); flags go after SKIP_HOST
CHECK_CASES = [
    (
        host.check_dynamic_batch_split,
        D3S_MOVING,
        [*REMOTE, "--train.dynamic_batch_enable", "--actor.num_gpus_per_node", "3"],
        [*REMOTE, "--train.dynamic_batch_enable", "--actor.num_gpus_per_node", "2"],
        "--train.batch_size 16 not a multiple of the actor's data-parallel size 3: ",
    ),
    (
        host.check_schedule_horizon,
        D3S_MOVING,
        [*REMOTE, "--algo.dynamic_filtering_enable"],
        REMOTE,
        "--algo.dynamic_filtering_enable consumes a varying number of prompts per step",
    ),
    (
        host.check_generation_rewards,
        SKIPPING,
        ["--reward.model_name_or_path", "rm"],
        REMOTE,
        "give rewards at generation time (--reward.remote_url or --train.agent_func_path)",
    ),
    (
        host.check_skip_group_size,
        SKIPPING,
        [*REMOTE, "--rollout.n_samples_per_prompt", "1"],
        REMOTE,
        "needs at least 2 rollouts per prompt; --rollout.n_samples_per_prompt is 1",
    ),
    (
        host.check_stall_passes,
        {"preset": "d3s", "schedule_steps": 20, "stall_passes": 2},
        REMOTE,
        [*REMOTE, "--algo.dynamic_filtering_enable"],
        "--d3s.stall_passes 2 does nothing here",
    ),
    (
        by_group(host.check_group_has_ranks, "ref"),
        D3S_MOVING,
        [*REMOTE, "--actor.num_gpus_per_node", "2", "--ds.ring_attn_size", "2", "--algo.kl.init_coef", "0.01"]
        + ["--ref.num_gpus_per_node", "1"],
        [*REMOTE, "--actor.num_gpus_per_node", "2", "--ds.ring_attn_size", "2", "--algo.kl.init_coef", "0.01"]
        + ["--ref.num_gpus_per_node", "2"],
        "the ref model group has an effective data-parallel size of 0 (--ref.num_nodes x --ref.num_gpus_per_node = 1",
    ),
    (
        by_group(host.check_group_divides_actor, "ref"),
        D3S_MOVING,
        [*REMOTE, "--train.dynamic_batch_enable", "--actor.num_gpus_per_node", "2", "--algo.kl.init_coef", "0.01"]
        + ["--ref.num_gpus_per_node", "3"],
        [*REMOTE, "--train.dynamic_batch_enable", "--actor.num_gpus_per_node", "2", "--algo.kl.init_coef", "0.01"]
        + ["--ref.num_gpus_per_node", "1"],
        "the ref model group's size 3 (--ref.num_nodes x --ref.num_gpus_per_node) does not divide",
    ),
    (
        host.check_reward_micro_batches,
        D3S_MOVING,
        ["--reward.model_name_or_path", "rm", "--reward.num_gpus_per_node", "3"],
        ["--reward.model_name_or_path", "rm", "--reward.num_gpus_per_node", "2"],
        "the reward model scores all 64 rollouts in 64 micro-batches of --rollout.micro_batch_size 1, which do not "
        "split evenly over its 3 data-parallel ranks",
    ),
    (
        host.check_estimator,
        D3S_MOVING,
        [*REMOTE, "--algo.advantage.estimator", "reinforce"],
        REMOTE,
        "--algo.advantage.estimator is reinforce; use one of",
    ),
    (
        host.check_selection_group_size,
        D3S_MOVING,
        [*REMOTE, "--rollout.n_samples_per_prompt", "1"],
        REMOTE,
        "--rollout.n_samples_per_prompt 1: sample selection needs groups of at least 2 rollouts per prompt",
    ),
    (
        host.check_selection_group_size,
        D3S_MOVING,
        [*REMOTE, "--rollout.n_samples_per_prompt", "4"],
        [*REMOTE, "--rollout.n_samples_per_prompt", "16"],
        "--rollout.n_samples_per_prompt 4 is below max(N) = 8 of the schedule: raise --rollout.n_samples_per_prompt "
        "to at least 8 or lower --d3s.n_init/--d3s.n_final (now 2/8)",
    ),
    (
        host.check_generate_batch_size,
        D3S_MOVING,
        [*REMOTE, "--rollout.vllm_generate_batch_size", "4"],
        [*REMOTE, "--rollout.vllm_generate_batch_size", "8"],
        "--rollout.vllm_generate_batch_size 4 is below --rollout.batch_size 8: every step trains 4 prompts' groups",
    ),
    (
        host.check_kept_unit,
        D3S_MOVING,
        [*REMOTE, "--rollout.batch_size", "5"],
        REMOTE,
        "the rollout batch of --rollout.batch_size 5 x --rollout.n_samples_per_prompt 8 = 40 rollouts is not a "
        "multiple of 16 = lcm(--train.batch_size 16",
    ),
]


CASE_IDS = [f"{getattr(case[0], 'func', case[0]).__name__}-{i}" for i, case in enumerate(CHECK_CASES)]


@pytest.mark.parametrize("check, fields, refused, passed, says", CHECK_CASES, ids=CASE_IDS)
def test_each_host_check_refuses_with_what_to_change_and_passes_otherwise(check, fields, refused, passed, says):
    config = D3SConfig.from_flags(fields)
    problem = check(config, host.parse_host_args([*SKIP_HOST, *refused]))
    assert problem is not None and says in problem
    assert check(config, host.parse_host_args([*SKIP_HOST, *passed])) is None
    # the same refusal, on its own line, from the validation
    with pytest.raises(host.D3SValidationError) as error:
        host.validate_against_host(config, host.parse_host_args([*SKIP_HOST, *refused]))
    assert problem in error.value.problems and f"\n  {problem}" in str(error.value)


@pytest.mark.parametrize("check, fields, refused, passed, says", CHECK_CASES, ids=CASE_IDS)
def test_only_the_sample_selection_checks_are_lifted_without_it(check, fields, refused, passed, says):
    no_selection = D3SConfig.from_flags({**fields, "sample_rule": "none"})
    lifted = check(no_selection, host.parse_host_args([*SKIP_HOST, *refused])) is None
    selection_check = getattr(check, "func", check) in {
        host.check_group_has_ranks,
        host.check_group_divides_actor,
        host.check_reward_micro_batches,
        host.check_estimator,
        host.check_selection_group_size,
        host.check_kept_unit,
    }
    assert lifted == selection_check


FIXED_BY_FILTERING = {"preset": "grpo", "chunked_logits": True, "schedule_steps": 20}
# a D3S run that counts B prompts a step: (D3S options, host flags, what the refusal says counts them)
COUNTS_B_PROMPTS = {
    "sample_selection": ({"preset": "d1s", "n_init": 4, "n_final": 4}, [], "sample selection's kept counts"),
    "skipping": (SKIPPING, [], "the --d3s.schedule_steps 20 fixed steps"),
    "filtering": (FIXED_BY_FILTERING, ["--algo.dynamic_filtering_enable"], "the --d3s.schedule_steps 20 fixed"),
    "moving_tokens": ({"preset": "grpo", "k_init": 0.1, "k_final": 0.5}, [], "the (N, K) schedule's horizon"),
}
# a D3S run that reads nothing of B: a step of fewer prompts is upstream's (its LR horizon counts prompts)
NO_B_PROMPTS = {
    "chunked_logits": {"preset": "grpo", "chunked_logits": True},
    "constant_tokens": {"preset": "grpo", "k_init": 0.5, "k_final": 0.5},
    "moving_tokens_with_steps": {"preset": "grpo", "k_init": 0.1, "k_final": 0.5, "schedule_steps": 20},
}


def generate_batch_problem(fields, *flags):
    return host.check_generate_batch_size(D3SConfig.from_flags(fields), host.parse_host_args([*SKIP_HOST, *flags]))


@pytest.mark.parametrize("mode", [[], ["--train.async_enable"]], ids=["sync", "async"])
@pytest.mark.parametrize("generate", ["4", "7"])
@pytest.mark.parametrize("case", COUNTS_B_PROMPTS)
def test_a_generate_batch_below_the_rollout_batch_is_refused_where_d3s_counts_b_prompts(case, generate, mode):
    # upstream's generate_samples draws --rollout.vllm_generate_batch_size prompts a step, sync and async alike
    fields, flags, says = COUNTS_B_PROMPTS[case]
    flags = [*REMOTE, *flags, *mode]
    problem = generate_batch_problem(fields, *flags, "--rollout.vllm_generate_batch_size", generate)
    assert f"--rollout.vllm_generate_batch_size {generate} is below --rollout.batch_size 8" in problem
    assert says in problem
    # the flag unset or 0 (upstream's default: B), B, or above B (async's over-sampling: B a step) reduces nothing
    assert generate_batch_problem(fields, *flags) is None
    for enough in ("0", "8", "16"):
        assert generate_batch_problem(fields, *flags, "--rollout.vllm_generate_batch_size", enough) is None


@pytest.mark.parametrize("case", NO_B_PROMPTS)
def test_a_generate_batch_below_the_rollout_batch_passes_where_d3s_counts_no_prompts(case):
    assert generate_batch_problem(NO_B_PROMPTS[case], *REMOTE, "--rollout.vllm_generate_batch_size", "4") is None


def test_every_host_check_has_a_case_of_its_own():
    # check_fixed_updates: its cases in test_fixed_updates_refuses_what_it_cannot_run (a config whose refusals need
    # sample selection: CHECK_CASES' lifting test takes it away)
    tested = {getattr(case[0], "func", case[0]) for case in CHECK_CASES} | {
        host.check_deepspeed,
        host.check_fixed_updates,
    }
    assert {getattr(check, "func", check) for check in host.HOST_CHECKS} == tested
    # and every model group is checked by the per-group checks
    groups = [check.keywords["group"] for check in host.HOST_CHECKS if hasattr(check, "func")]
    assert sorted(groups) == sorted(2 * list(host.MODEL_GROUPS))


def test_the_deepspeed_check(monkeypatch):
    config, args = D3SConfig.from_flags(D3S_MOVING), host.parse_host_args([*SKIP_HOST, *REMOTE])
    monkeypatch.setattr(host, "installed_deepspeed", lambda: "0.19.6")
    assert host.check_deepspeed(config, args) is None
    monkeypatch.setattr(host, "installed_deepspeed", lambda: "0.17.0")
    assert "deepspeed 0.17.0 is installed" in host.check_deepspeed(config, args)


def test_every_host_problem_is_reported_at_once():
    flags = [*SKIP_HOST, "--reward.model_name_or_path", "rm", "--reward.num_gpus_per_node", "3"]
    flags += ["--algo.advantage.estimator", "reinforce", "--rollout.batch_size", "5", "--algo.dynamic_filtering_enable"]
    config = D3SConfig.from_flags(D3S_MOVING)
    with pytest.raises(host.D3SValidationError) as error:
        host.validate_against_host(config, host.parse_host_args(flags))
    checks = [host.check_schedule_horizon, host.check_reward_micro_batches, host.check_estimator, host.check_kept_unit]
    args = host.parse_host_args(flags)
    expected = [check(config, args) for check in checks]
    assert None not in expected
    assert [problem for problem in error.value.problems if "deepspeed" not in problem] == expected
    assert str(error.value) == "D3S cannot run with these flags:\n  " + "\n  ".join(error.value.problems)
