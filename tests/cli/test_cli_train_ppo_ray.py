"""The ``python -m d3s_openrlhf.cli.train_ppo_ray`` entrypoint against OpenRLHF 0.11.2's own CLI module.

Upstream's ``openrlhf.cli.train_ppo_ray`` really runs (through runpy) in the off/on tests; they pick host flags
that upstream's own validation rejects right after ``hierarchize``, so the run stops with upstream's assertion
before ``train()``/``ray.init``. A spy around ``runpy.run_module`` records what upstream's module sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys

import openrlhf.trainer.ppo_trainer as ppo_trainer
import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
import openrlhf.trainer.ray as trainer_ray
import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
import openrlhf.utils.config as host_config
import pytest
import ray

from d3s_openrlhf.cli import train_ppo_ray as cli
from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration import host


def _swappable_globals():
    return {
        "PolicyModelActor": ppo_actor.PolicyModelActor,
        "PPOTrainer": ppo_trainer.PPOTrainer,
        "PPOTrainerAsync": ppo_trainer_async.PPOTrainerAsync,
        "hierarchize": host_config.hierarchize,
        "get": ray.get,
        "create_vllm_engines": trainer_ray.create_vllm_engines,
        "RayActorGroup": launcher.RayActorGroup,
    }


UPSTREAM = _swappable_globals()


def driver_watch(run, engine_gap=False):
    """The globals of the driver's watch a run saw (D3S on and off), checked to be one ``DriverWatch``'s, over
    engines that report their log-probs when the run logs the engine's gap (``engine_gap``)."""
    from d3s_openrlhf.integration.driver_watch import DriverWatch

    names = ("get", "create_vllm_engines", "RayActorGroup")
    watch = {name: run["globals"][name] for name in names}
    assert isinstance(watch["get"].__self__, DriverWatch) and watch["RayActorGroup"].__self__ is watch["get"].__self__
    created = watch["create_vllm_engines"].__wrapped__
    if engine_gap:
        assert created is not UPSTREAM["create_vllm_engines"]
        created = created.__wrapped__
    assert created is UPSTREAM["create_vllm_engines"]
    return watch


HOST = [
    "--algo.advantage.estimator",
    "group_norm",
    "--rollout.batch_size",
    "8",
    "--rollout.n_samples_per_prompt",
    "16",
    "--rollout.micro_batch_size",
    "2",
    "--train.batch_size",
    "32",
    "--actor.num_nodes",
    "1",
    "--actor.num_gpus_per_node",
    "2",
]


@pytest.fixture
def upstream_runs(monkeypatch):
    """Spy on the runpy call of the entrypoint: what upstream's module was run with and which classes it saw."""
    seen = []
    real_run_module = host.runpy.run_module

    def spy(name, *args, **kwargs):
        if kwargs.get("run_name") == "__main__":
            probe = host_config.hierarchize(argparse.Namespace(**{"rollout.batch_size": 3}))
            seen.append(
                dict(
                    module=name,
                    argv=list(sys.argv[1:]),
                    globals=_swappable_globals(),
                    d3s=getattr(probe, "d3s", None),
                )
            )
        return real_run_module(name, *args, **kwargs)

    host.upstream_parser()  # build (and cache) upstream's parser before the spy starts recording
    monkeypatch.setattr(host.runpy, "run_module", spy)
    return seen


# ── --help ──


def test_help_lists_upstream_flags_then_d3s_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--rollout.n_samples_per_prompt", "--algo.advantage.estimator", "--train.batch_size"):
        assert flag in out
    for field in dataclasses.fields(D3SConfig):
        assert f"--d3s.{field.name}" in out
    assert out.index("--algo.advantage.estimator") < out.index("--d3s.preset")


def test_help_of_the_module_entrypoint():
    result = subprocess.run(
        [sys.executable, "-m", "d3s_openrlhf.cli.train_ppo_ray", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--actor.model_name_or_path" in result.stdout and "--d3s.sample_scope" in result.stdout


# ── off and on ──


def pass_at_k_trainers():
    from d3s_openrlhf.integration.eval_metrics import PassAtKPPOTrainer, PassAtKPPOTrainerAsync

    return dict(PPOTrainer=PassAtKPPOTrainer, PPOTrainerAsync=PassAtKPPOTrainerAsync)


def test_d3s_off_runs_upstream_with_the_pass_at_k_evaluation_alone(upstream_runs):
    # group_norm with one sample per prompt: upstream's own check fails right after its parsing.
    argv = ["--d3s.preset", "grpo", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "1"]
    with pytest.raises(AssertionError, match="group_norm requires n_samples_per_prompt > 1"):
        cli.main(argv)
    assert len(upstream_runs) == 1
    run = upstream_runs[0]
    assert run["module"] == "openrlhf.cli.train_ppo_ray"
    assert run["argv"] == argv[2:]  # the --d3s.* flags are not passed on
    # the trainers' evaluation adds the unbiased pass@k (the metric a D3S run logs), and the driver's waits watch the
    # actors; nothing else changes
    assert run["globals"] == dict(UPSTREAM, **pass_at_k_trainers(), **driver_watch(run)) and run["d3s"] is None
    assert _swappable_globals() == UPSTREAM  # for the run only


def test_lora_with_d3s_off_swaps_in_the_merged_weight_sync(upstream_runs):
    from d3s_openrlhf.integration.lora_sync import LoRASyncPolicyModelActor

    # LoRA: upstream's weight sync cannot reach vLLM, so the entrypoint swaps its policy actor even with D3S off
    argv = ["--ds.lora.rank", "8", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "1"]
    with pytest.raises(AssertionError, match="group_norm requires n_samples_per_prompt > 1"):
        cli.main(argv)
    (run,) = upstream_runs
    assert run["argv"] == argv and run["d3s"] is None
    watch = driver_watch(run, engine_gap=True)
    expected = dict(UPSTREAM, PolicyModelActor=LoRASyncPolicyModelActor, **pass_at_k_trainers(), **watch)
    assert run["globals"] == expected
    assert _swappable_globals() == UPSTREAM  # for the run only


def test_lora_with_tensor_parallelism_is_refused_before_upstream_runs(upstream_runs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--ds.lora.rank", "8", "--ds.tensor_parallel_size", "2"])
    assert exit_info.value.code == 2 and not upstream_runs
    assert "--ds.tensor_parallel_size 1" in capsys.readouterr().err


def test_d3s_on_swaps_classes_and_injects_config_for_the_run_only(upstream_runs):
    from d3s_openrlhf.integration.actor import D3SPolicyModelActor
    from d3s_openrlhf.integration.trainer import D3SPPOTrainer, D3SPPOTrainerAsync

    # partial rollouts without async: upstream's own check fails after hierarchize, before train().
    argv = ["--d3s.preset", "d3s", "--d3s.n_final", "16", *HOST, "--train.partial_rollout_enable"]
    with pytest.raises(AssertionError, match="partial_rollout_enable requires"):
        cli.main(argv)
    assert len(upstream_runs) == 1
    run = upstream_runs[0]
    assert run["argv"] == HOST + ["--train.partial_rollout_enable"]
    assert run["globals"] == {
        "PolicyModelActor": D3SPolicyModelActor,
        "PPOTrainer": D3SPPOTrainer,
        "PPOTrainerAsync": D3SPPOTrainerAsync,
        "hierarchize": run["globals"]["hierarchize"],
        **driver_watch(run),
    }
    assert run["globals"]["hierarchize"] is not UPSTREAM["hierarchize"]
    expected = D3SConfig.from_flags({"preset": "d3s", "n_final": 16})
    assert vars(run["d3s"]) == expected.to_dict()
    assert _swappable_globals() == UPSTREAM  # restored after the run
    assert not ray.is_initialized()


# ── validation ──


def _error(argv):
    with pytest.raises(cli.D3SValidationError) as error:
        cli.resolve(argv)
    return str(error.value)


def _host(**changes):
    """HOST with some flag values replaced (``estimator="gae"`` replaces --algo.advantage.estimator)."""
    argv = list(HOST)
    names = {"estimator": "--algo.advantage.estimator"}
    for key, value in changes.items():
        flag = names.get(key, "--" + key)
        argv[argv.index(flag) + 1] = str(value)
    return argv


@pytest.mark.parametrize("estimator", ["gae", "reinforce"])
def test_error_non_group_estimator_with_sample_selection(estimator):
    message = _error(["--d3s.preset", "d1s", "--d3s.n_init", "4", *_host(estimator=estimator)])
    assert f"--algo.advantage.estimator is {estimator}" in message and "--d3s.sample_rule" in message


def test_token_selection_alone_accepts_any_estimator():
    config, _, _, plan = cli.resolve(["--d3s.k_init", "0.2", "--d3s.k_final", "0.5", *_host(estimator="gae")])
    assert config.tokens_enabled and not config.samples_enabled and plan.kept_by_n == {}


def test_error_one_sample_per_prompt():
    message = _error(["--d3s.preset", "d1s", "--d3s.n_init", "1", *_host(**{"rollout.n_samples_per_prompt": 1})])
    assert "--rollout.n_samples_per_prompt 1" in message and "at least 2" in message


def test_error_group_smaller_than_max_n():
    message = _error(["--d3s.preset", "d3s", *HOST])  # N goes up to 32, G = 16
    assert "--rollout.n_samples_per_prompt 16 is below max(N) = 32" in message
    assert "--d3s.n_init/--d3s.n_final" in message


@pytest.mark.parametrize("flag, value", [("k_init", "0"), ("k_final", "1.5"), ("k_init", "-0.1")])
def test_error_k_outside_unit_interval(flag, value):
    message = _error(["--d3s.preset", "d3s", "--d3s.n_final", "16", f"--d3s.{flag}", value, *HOST])
    assert f"--d3s.{flag}" in message and "(0, 1]" in message


def test_error_batch_not_a_multiple_of_the_unit():
    # B*G = 8*16 = 128 is no multiple of lcm(--train.batch_size 48, 2 x dp 2) = 48
    message = _error(["--d3s.preset", "d1s", "--d3s.n_init", "4", *_host(**{"train.batch_size": 48})])
    assert "128 rollouts is not a multiple of 48" in message
    flags = ("--train.batch_size", "--rollout.micro_batch_size", "--rollout.batch_size", "--actor.num_gpus_per_node")
    assert all(flag in message for flag in flags)


def test_error_batch_unit_with_dynamic_batching():
    argv = ["--d3s.preset", "d1s", "--d3s.n_init", "4", *_host(**{"train.batch_size": 48})]
    groups = ["--ref.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "1"]  # sizes dividing the actor's
    message = _error([*argv, *groups, "--train.dynamic_batch_enable"])
    assert "lcm(--train.batch_size 48, data-parallel size 2)" in message and message.count("\n  ") == 1


def test_error_dynamic_batching_with_a_train_batch_the_ranks_do_not_divide():
    argv = ["--d3s.k_init", "0.5", *_host(**{"train.batch_size": 33}), "--train.dynamic_batch_enable"]
    message = _error(argv)
    assert "--train.batch_size 33 not a multiple of the actor's data-parallel size 2" in message


@pytest.mark.parametrize("group", ["ref", "reward"])
def test_error_dynamic_batching_with_a_forward_group_whose_size_does_not_divide_the_actors(group):
    sizes = {"ref": "2", "reward": "2"} | {group: "3"}
    argv = ["--d3s.preset", "d1s", "--d3s.n_init", "4", *HOST, "--train.dynamic_batch_enable"]
    for name, size in sizes.items():
        argv += [f"--{name}.num_gpus_per_node", size]
    message = _error(argv)
    assert f"the {group} model group's size 3 (--{group}.num_nodes x --{group}.num_gpus_per_node)" in message
    assert message.count("\n  ") == 1


def test_reference_model_ranks_are_folded_into_the_unit():
    # actor 2 ranks, reference 3 ranks, micro-batch 2: kept / 2 micro-batches must split over 2 and 3 ranks
    argv = ["--d3s.preset", "d1s", "--d3s.n_init", "4", *_host(**{"train.batch_size": 8, "rollout.batch_size": 6})]
    argv += ["--ref.num_gpus_per_node", "3", "--reward.num_gpus_per_node", "1"]
    _, _, _, plan = cli.resolve(argv)
    assert plan.unit == 24  # lcm(8, 2 x lcm(2, 3))
    assert all(kept % 24 == 0 for kept in plan.kept_by_n.values())
    # without a KL term there is no reference model: lcm(8, 2 x 2) = 8
    _, _, _, plan = cli.resolve([*argv, "--algo.kl.init_coef", "0"])
    assert plan.unit == 8


def test_error_reward_model_forwards_that_do_not_split_evenly():
    # 8 x 16 = 128 rollouts in 64 micro-batches of 2 over a reward model on 3 ranks
    message = _error(["--d3s.preset", "d1s", "--d3s.n_init", "4", *HOST, "--reward.num_gpus_per_node", "3"])
    assert "64 micro-batches" in message and "--reward.num_nodes x --reward.num_gpus_per_node" in message
    # scored by a reward function, no reward model runs
    flags = ["--reward.num_gpus_per_node", "3", "--reward.remote_url", "reward.py"]
    cli.resolve(["--d3s.preset", "d1s", "--d3s.n_init", "4", *HOST, *flags])


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_error_dynamic_filtering_with_a_moving_schedule_needs_schedule_steps(schedule):
    argv = ["--d3s.preset", "d3s", "--d3s.n_final", "16", "--d3s.schedule", schedule, *HOST]
    argv += ["--algo.dynamic_filtering_enable", "--reward.remote_url", "reward.py"]
    message = _error(argv)
    assert "--algo.dynamic_filtering_enable" in message and "--d3s.schedule_steps" in message
    cli.resolve([*argv, "--d3s.schedule_steps", "100"])
    cli.resolve([*argv, "--d3s.schedule", "constant"])


def test_error_schedule_steps_with_d3s_off_is_refused_before_ray(upstream_runs, capsys):
    # upstream's dynamic filtering alone would train its own passes: the steps asked for would be ignored
    argv = ["--d3s.schedule_steps", "150", "--algo.dynamic_filtering_enable", "--reward.remote_url", "r.py", *HOST]
    assert "--d3s.schedule_steps=150: does nothing with D3S off" in _error(argv)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--d3s.dry_run"])  # the dry run says so too, rather than "D3S is off"
    assert exit_info.value.code == 2
    assert "--d3s.schedule_steps=150: does nothing with D3S off" in capsys.readouterr().err
    assert upstream_runs == [] and not ray.is_initialized()
    cli.resolve([*argv, "--d3s.chunked_logits"])  # D3S on: the run trains the 150 steps


def test_error_a_generate_batch_below_the_rollout_batch_names_both_flags():
    generate = ["--rollout.vllm_generate_batch_size", "4"]
    message = _error(["--d3s.preset", "d3s", "--d3s.n_final", "16", *HOST, *generate])
    assert "--rollout.vllm_generate_batch_size 4 is below --rollout.batch_size 8" in message
    # D3S off: upstream's run, whose LR horizon counts prompts, not steps of B
    assert cli.resolve([*HOST, *generate])[3] is None


def test_errors_are_reported_together():
    message = _error(["--d3s.preset", "d3s", *_host(estimator="gae", **{"train.batch_size": 48})])
    assert message.count("\n  ") == 3  # estimator, max(N), unit


def test_error_unknown_d3s_flag():
    assert "--d3s.n_inital" in _error(["--d3s.n_inital", "4", *HOST])


def test_error_subset_advantages_without_selection():
    message = _error(["--d3s.advantage_mode", "subset", "--d3s.k_init", "0.5", *HOST])
    assert "--d3s.advantage_mode" in message and "--d3s.sample_rule" in message


def test_main_reports_validation_errors_before_ray(upstream_runs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--d3s.preset", "d3s", *HOST])
    assert exit_info.value.code == 2
    assert "d3s_openrlhf.cli.train_ppo_ray: error:" in capsys.readouterr().err
    assert upstream_runs == [] and not ray.is_initialized()


def test_bad_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--d3s.sample_scope", "everywhere", *HOST])
    assert exit_info.value.code == 2
    assert "--d3s.sample_scope" in capsys.readouterr().err


def test_plan_rounds_every_n_of_the_schedule_up_to_the_unit():
    config, _, host_args, plan = cli.resolve(["--d3s.preset", "d3s", "--d3s.n_final", "16", *HOST])
    assert host_args.rollout.n_samples_per_prompt == 16
    assert (plan.unit, plan.dp_size, plan.total) == (32, 2, 128)
    assert set(plan.kept_by_n) == set(range(8, 17))
    for n, kept in plan.kept_by_n.items():
        assert kept % 32 == 0 and n * 8 <= kept < n * 8 + 32
    assert plan.notes == ()


def test_plan_notes_when_selection_can_never_drop_a_rollout():
    _, _, _, plan = cli.resolve(["--d3s.preset", "d1s", "--d3s.n_init", "4", *_host(**{"train.batch_size": 128})])
    assert plan.kept_by_n == {4: 128} and "never drops a rollout" in plan.notes[0]


# ── dry run ──


def test_dry_run_prints_the_resolved_config_and_schedule_without_ray(upstream_runs, capsys):
    cli.main(["--d3s.preset", "d3s", "--d3s.n_final", "16", "--d3s.dry_run", *HOST])
    out = capsys.readouterr().out
    assert "--d3s.preset d3s" in out and "--d3s.n_final 16" in out
    assert "optimizer steps (--d3s.optimizer_steps fixed_batch): per epoch of a rollout step, one per" in out
    assert "p = 0.00:  N =   8  kept rollouts     64 / 128 (50.0%)  optimizer steps 2 x 32 rollouts  K = 0.0500" in out
    assert "p = 1.00:  N =  16  kept rollouts    128 / 128 (100.0%)  optimizer steps 4 x 32 rollouts  K = 0.2000" in out
    assert upstream_runs == [] and not ray.is_initialized()


def test_dry_run_with_schedule_steps_prints_steps_the_run_trains(capsys):
    # S = 5 steps, logged as steps 1 .. 5 (upstream logs global step s after training s - 1): N 8 -> 16 over them
    cli.main(["--d3s.preset", "d3s", "--d3s.n_final", "16", "--d3s.schedule_steps", "5", "--d3s.dry_run", *HOST])
    out = capsys.readouterr().out
    assert "over --d3s.schedule_steps 5" in out
    points = re.findall(r"step +(\d+):  N = +(\d+)  kept rollouts +\d+ / 128 \([\d.]+%\)  .*  K = ([\d.]+)", out)
    assert [(int(step), int(n), float(k)) for step, n, k in points] == [
        (1, 8, 0.05),
        (2, 10, 0.0875),
        (3, 12, 0.125),
        (4, 14, 0.1625),
        (5, 16, 0.2),
    ]


@pytest.mark.parametrize(
    "level",
    [
        ["--d3s.prompt_skip", "history"],
        ["--d3s.preset", "d1s", "--d3s.n_init", "8", "--d3s.n_final", "8", "--algo.dynamic_filtering_enable"],
    ],
)
def test_dry_run_prints_the_fixed_steps_and_the_passes_they_take(level, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join('{"input": "q%d", "label": "a"}\n' % i for i in range(100)))
    flags = ["--d3s.preset", "grpo", "--d3s.schedule_steps", "50", *level, "--reward.remote_url", "r.py"]
    cli.main([*flags, "--d3s.dry_run", *HOST, "--data.prompt_dataset", str(prompts)])
    out = capsys.readouterr().out
    batch = HOST[HOST.index("--rollout.batch_size") + 1]
    passes = 50 * int(batch) / 100
    assert f"the run trains --d3s.schedule_steps 50 steps of {batch} prompts" in out
    assert f"{passes:.2f} passes over 100 prompts at the least" in out
    cli.main([*flags, "--d3s.dry_run", *HOST, "--data.prompt_dataset", "some/hub-dataset"])
    assert "passes over the data = that / the dataset's size" in capsys.readouterr().out


def test_dry_run_with_d3s_off(upstream_runs, capsys):
    cli.main(["--d3s.dry_run", *HOST])
    out = capsys.readouterr().out
    assert "D3S is off" in out and "LoRA" not in out and upstream_runs == []
    cli.main(["--d3s.dry_run", *HOST, "--ds.lora.rank", "8"])  # the one change without a --d3s flag is said
    assert "merged LoRA layers" in capsys.readouterr().out and upstream_runs == []


def test_async_mode_validates_and_dry_runs(upstream_runs, capsys):
    cli.main(["--d3s.preset", "d3s", "--d3s.n_final", "16", "--train.async_enable", "--d3s.dry_run", *HOST])
    assert "kept rollouts" in capsys.readouterr().out
    assert upstream_runs == [] and not ray.is_initialized()


# ── the CPU runtime's GPU check (D3S_OPENRLHF_CPU=1) ──

REMOTE_REWARD = ["--reward.remote_url", "reward.py"]


@pytest.mark.parametrize("d3s", [["--d3s.preset", "d3s", "--d3s.n_final", "16"], []], ids=["d3s_on", "d3s_off"])
def test_cpu_runtime_refuses_a_run_that_would_wait_for_gpus(d3s, monkeypatch, capsys):
    monkeypatch.setenv("D3S_OPENRLHF_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # upstream's default --ref.num_gpus_per_node is 8: 2 actor + 8 reference GPUs > the runtime's 8
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*d3s, "--algo.kl.init_coef", "0.01", *REMOTE_REWARD, *HOST])
    assert exit_info.value.code == 2
    assert "--ref.num_nodes x --ref.num_gpus_per_node = 8" in capsys.readouterr().err
    assert not ray.is_initialized()
