import argparse
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.core.config import (
    ADVANTAGE_MODES,
    PRESETS,
    SAMPLE_RULES,
    SAMPLE_SCOPES,
    D3SConfig,
)
from d3s_openrlhf.core.schedule import SCHEDULE_KINDS, DownSamplingSchedule
from d3s_openrlhf.core.token_mask import TOKEN_SCOPES

PROPERTY = settings(max_examples=200, deadline=None)
FIELDS = [f.name for f in dataclasses.fields(D3SConfig)]


def parser_with_flags():
    parser = argparse.ArgumentParser(prog="train")
    parser.add_argument("--rollout.n_samples_per_prompt", type=int, default=8)
    D3SConfig.add_arguments(parser)
    return parser


def test_defaults_are_off():
    config = D3SConfig()
    assert not config.enabled and not config.samples_enabled and not config.tokens_enabled
    assert config.preset is None and config.dry_run is False


def test_presets_follow_the_variant_table():
    resolved = {name: D3SConfig.from_flags({"preset": name}) for name in PRESETS}
    assert set(resolved) == {"grpo", "pods", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i"}
    for name, config in resolved.items():
        assert config.preset == name
        for key, value in PRESETS[name].items():
            assert getattr(config, key) == value
    assert not resolved["grpo"].enabled
    pods = resolved["pods"]
    assert (pods.sample_scope, pods.sample_rule, pods.advantage_mode) == ("intra", "max_var", "subset")
    assert (pods.n_init, pods.max_n, pods.tokens_enabled, pods.schedule) == (16, 16, False, "constant")
    for name, scope in (("d1s", "intra"), ("d1s-cross", "cross")):
        config = resolved[name]
        assert config.samples_enabled and not config.tokens_enabled
        assert (config.sample_scope, config.advantage_mode, config.schedule) == (scope, "group", "constant")
        assert config.n_init == config.n_final
    d2s = resolved["d2s"]
    assert d2s.samples_enabled and d2s.tokens_enabled and d2s.sample_scope == "cross"
    assert d2s.schedule == "constant" and d2s.k_init == d2s.k_final < 1
    for name, scope in (("d3s", "cross"), ("d3s-i", "intra")):
        config = resolved[name]
        assert (config.sample_scope, config.sample_rule, config.advantage_mode) == (scope, "max_var", "group")
        assert (config.n_init, config.n_final, config.k_init, config.k_final) == (8, 32, 0.05, 0.20)
        assert config.schedule == "linear" and config.max_n == 32 and config.tokens_enabled


def test_explicit_values_override_the_preset_and_none_means_not_given():
    config = D3SConfig.from_flags({"d3s.preset": "d3s", "d3s.n_init": 4, "k_final": 0.5, "d3s.seed": None})
    assert (config.preset, config.n_init, config.n_final, config.k_init, config.k_final) == ("d3s", 4, 32, 0.05, 0.5)
    assert config.seed == D3SConfig().seed
    assert D3SConfig.from_flags({}) == D3SConfig()
    assert D3SConfig.from_flags({"d3s.preset": "grpo", "d3s.k_init": 0.3}).tokens_enabled


def test_from_flags_rejects_unknown_keys():
    with pytest.raises(ValueError, match="'d3s.n_inti'"):
        D3SConfig.from_flags({"d3s.n_inti": 3})
    with pytest.raises(ValueError, match="'rollout.batch_size'"):
        D3SConfig.from_flags({"rollout.batch_size": 3})


BAD_VALUES = [
    ("preset", "d4s", "unknown preset"),
    ("sample_scope", "global", "one of intra, cross"),
    ("sample_rule", "max_entropy", "one of max_var"),
    ("advantage_mode", "whiten", "one of group, subset"),
    ("schedule", "step", "one of linear, cosine, constant"),
    ("token_scope", "row", "one of batch, sequence"),
    ("n_init", 0, "int >= 1"),
    ("n_final", -2, "int >= 1"),
    ("n_init", 1.5, "int >= 1"),
    ("n_final", True, "int >= 1"),
    ("k_init", 0.0, r"in \(0, 1\]"),
    ("k_init", 1.5, r"in \(0, 1\]"),
    ("k_final", float("nan"), r"in \(0, 1\]"),
    ("k_final", -0.1, r"in \(0, 1\]"),
    ("k_init", "0.5", r"in \(0, 1\]"),
    ("k_final", False, r"in \(0, 1\]"),
    ("schedule_steps", -1, "int >= 0"),
    ("schedule_steps", 2.0, "int >= 0"),
    ("seed", -5, "int >= 0"),
    ("full_logits", 1, "bool"),
    ("chunked_logits", "no", "bool"),
    ("dry_run", "yes", "bool"),
    ("prompt_skip", "always", "one of off, history"),
    ("skip_base", 0.99, r"in \[0.05, 0.95\]"),
    ("skip_base", float("nan"), r"in \[0.05, 0.95\]"),
    ("skip_floor", 0.001, r"in \[0.01, 1\) \(the exploration floor\)"),
    ("skip_floor", 1.0, r"in \[0.01, 1\)"),
    ("skip_target", 1.0, r"in \[0, 1\)"),
    ("skip_target", float("nan"), r"in \[0, 1\)"),
    ("skip_rate", 0.0, "> 0"),
    ("skip_rate", True, "> 0"),
    ("stall_passes", 0, "an int >= 1"),
    ("stall_passes", 2.5, "an int >= 1"),
    ("stall_passes", True, "an int >= 1"),
    ("optimizer_steps", "per_token", "one of fixed_batch, fixed_updates"),
]


def test_fixed_updates_needs_sample_selection():
    with pytest.raises(ValueError, match=r"--d3s.optimizer_steps='fixed_updates'.*--d3s.sample_rule none"):
        D3SConfig(optimizer_steps="fixed_updates")
    assert D3SConfig.from_flags({"preset": "pods", "optimizer_steps": "fixed_updates"}).samples_enabled


@pytest.mark.parametrize("name, value, reason", BAD_VALUES)
def test_every_field_validation_error_names_the_flag_and_value(name, value, reason):
    with pytest.raises(ValueError, match=reason) as excinfo:
        D3SConfig(**{name: value})
    assert f"--d3s.{name}={value!r}: " in str(excinfo.value)


def test_validation_covers_every_field_with_a_constraint():
    constrained = {name for name, _, _ in BAD_VALUES}
    assert constrained == set(FIELDS)


def test_subset_advantages_need_a_sample_rule():
    with pytest.raises(ValueError, match=r"--d3s.advantage_mode='subset'.*--d3s.sample_rule='none'"):
        D3SConfig(advantage_mode="subset", sample_rule="none")
    assert D3SConfig(advantage_mode="subset", sample_rule="random").samples_enabled


@pytest.mark.parametrize("off", [{}, {"preset": "grpo"}, {"preset": "grpo", "full_logits": True, "seed": 3}])
def test_schedule_steps_with_d3s_off_is_refused(off):
    # D3S off is upstream's run, which trains its own passes (dynamic filtering included): nothing reads the steps
    with pytest.raises(ValueError, match=r"--d3s.schedule_steps=150: does nothing with D3S off") as error:
        D3SConfig.from_flags({**off, "schedule_steps": 150})
    assert "--d3s.chunked_logits" in str(error.value)
    assert not D3SConfig.from_flags({**off, "schedule_steps": 0}).enabled


@pytest.mark.parametrize(
    "on",
    [{"chunked_logits": True}, {"k_init": 0.5}, {"preset": "d1s"}, {"prompt_skip": "history"}],
)
def test_schedule_steps_with_d3s_on_is_taken(on):
    assert D3SConfig.from_flags({"preset": "grpo", **on, "schedule_steps": 150}).schedule_steps == 150


def test_stall_passes_with_d3s_off_is_refused():
    with pytest.raises(ValueError, match="does nothing with D3S off"):
        D3SConfig.from_flags({"stall_passes": 8})
    assert D3SConfig.from_flags({"stall_passes": 8, "chunked_logits": True}).stall_passes == 8


def test_chunked_logits_turns_d3s_on_and_contradicts_full_logits():
    with pytest.raises(ValueError, match=r"--d3s.chunked_logits=True: contradicts --d3s.full_logits"):
        D3SConfig(chunked_logits=True, full_logits=True)
    alone = D3SConfig(chunked_logits=True)
    assert alone.enabled and not (alone.samples_enabled or alone.tokens_enabled or alone.skip_enabled)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError) as excinfo:
        D3SConfig.from_flags({"preset": "d3s", "n_init": 0, "k_final": 2.0, "token_scope": "row"})
    message = str(excinfo.value)
    for flag in ("--d3s.n_init=0", "--d3s.k_final=2.0", "--d3s.token_scope='row'"):
        assert flag in message
    # the same problems as fields: no caller reads them back out of the message
    problems = {problem.parameter: problem for problem in excinfo.value.problems}
    assert set(problems) == {"--d3s.n_init", "--d3s.k_final", "--d3s.token_scope"}
    assert problems["--d3s.n_init"].value == 0 and problems["--d3s.n_init"].requirement.startswith("must be an int")
    assert problems["--d3s.k_final"].value == 2.0


def test_skip_options_carry_the_policys_requirement_under_their_flag():
    with pytest.raises(ValueError) as excinfo:
        D3SConfig(skip_floor=0.0, skip_rate=-1.0)
    by_flag = {problem.parameter: problem for problem in excinfo.value.problems}
    assert set(by_flag) == {"--d3s.skip_floor", "--d3s.skip_rate"}
    assert by_flag["--d3s.skip_floor"].requirement == "must be a number in [0.01, 1) (the exploration floor)"
    assert by_flag["--d3s.skip_rate"].value == -1.0


def test_decreasing_schedules_and_integer_fractions_are_accepted():
    config = D3SConfig(sample_rule="max_var", n_init=32, n_final=8, k_init=1, k_final=0.5)
    assert config.max_n == 32 and config.k_init == 1.0 and type(config.k_init) is float
    assert config.tokens_enabled


def test_frozen():
    config = D3SConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_init = 3


def test_derived_properties():
    assert not D3SConfig(schedule="constant", k_init=1.0, k_final=0.1).tokens_enabled  # K_final unused
    assert D3SConfig(schedule="cosine", k_init=1.0, k_final=0.1).tokens_enabled
    assert D3SConfig(schedule="constant", n_init=4, n_final=64).max_n == 4
    assert D3SConfig(schedule="linear", n_init=4, n_final=64).max_n == 64
    assert D3SConfig(k_init=0.5).enabled and not D3SConfig(k_init=1.0).enabled


def test_schedule_for():
    config = D3SConfig.from_flags({"preset": "d3s"})
    schedule = config.schedule_for(201)
    assert schedule == DownSamplingSchedule(8, 32, 0.05, 0.2, 201, kind="linear")
    assert schedule.at(100) == (20, pytest.approx(0.125))
    pinned = D3SConfig.from_flags({"preset": "d3s", "schedule_steps": 10}).schedule_for(200)
    assert pinned.total_steps == 10 and pinned.at(9) == (32, 0.2)
    with pytest.raises(ValueError, match="total_steps"):
        config.schedule_for(0)


def test_to_dict():
    config = D3SConfig.from_flags({"preset": "pods"})
    assert config.to_dict() == {name: getattr(config, name) for name in FIELDS}


def test_every_field_has_help_and_the_paper_symbols_are_cited():
    for f in dataclasses.fields(D3SConfig):
        assert len(f.metadata["help"]) > 20, f.name
    help_of = {f.name: f.metadata["help"] for f in dataclasses.fields(D3SConfig)}
    assert "N_init" in help_of["n_init"] and "PODS m" in help_of["n_init"]
    assert "N_final" in help_of["n_final"]
    assert "K_init" in help_of["k_init"] and "K_final" in help_of["k_final"]
    assert "|A_{i,t}|*H_{i,t}" in help_of["k_init"]
    assert "Var(A')" in help_of["sample_rule"]


def test_generated_flags():
    parser = parser_with_flags()
    defaults = vars(parser.parse_args([]))
    assert {key for key in defaults if key.startswith("d3s.")} == {f"d3s.{name}" for name in FIELDS}
    assert all(defaults[f"d3s.{name}"] is None for name in FIELDS)
    assert defaults["rollout.n_samples_per_prompt"] == 8
    help_text = parser.format_help()
    for name in FIELDS:
        assert f"--d3s.{name}" in help_text
    assert "(default: 32)" in help_text and "d3s-i" in help_text
    assert "{max_var,max_reward,random,none}" in help_text
    parsed = vars(parser.parse_args(["--d3s.dry_run", "--d3s.k_init", "0.1", "--d3s.preset", "d2s"]))
    assert parsed["d3s.dry_run"] is True and parsed["d3s.k_init"] == 0.1 and parsed["d3s.preset"] == "d2s"
    for bad in (["--d3s.sample_rule", "best"], ["--d3s.n_init", "two"], ["--d3s.preset", "d4s"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_flags_pass_through_parse_known_args_beside_host_flags():
    parser = argparse.ArgumentParser()
    D3SConfig.add_arguments(parser)
    known, rest = parser.parse_known_args(["--actor.model_name_or_path", "x", "--d3s.preset", "pods"])
    assert rest == ["--actor.model_name_or_path", "x"]
    assert D3SConfig.from_flags(vars(known)) == D3SConfig.from_flags({"preset": "pods"})


@st.composite
def configs(draw):
    rule = draw(st.sampled_from(SAMPLE_RULES))
    modes = ADVANTAGE_MODES if rule != "none" else ("group",)
    full_logits = draw(st.booleans())
    fields = dict(
        preset=draw(st.none() | st.sampled_from(sorted(PRESETS))),
        sample_scope=draw(st.sampled_from(SAMPLE_SCOPES)),
        sample_rule=rule,
        advantage_mode=draw(st.sampled_from(modes)),
        n_init=draw(st.integers(1, 256)),
        n_final=draw(st.integers(1, 256)),
        k_init=draw(st.floats(1e-6, 1.0)),
        k_final=draw(st.floats(1e-6, 1.0)),
        schedule=draw(st.sampled_from(SCHEDULE_KINDS)),
        schedule_steps=draw(st.integers(0, 10_000)),
        token_scope=draw(st.sampled_from(TOKEN_SCOPES)),
        seed=draw(st.integers(0, 2**32)),
        full_logits=full_logits,
        chunked_logits=draw(st.booleans()) and not full_logits,
        dry_run=draw(st.booleans()),
    )
    if not D3SConfig(**{**fields, "schedule_steps": 0}).enabled:
        fields["schedule_steps"] = 0  # refused with D3S off
    return D3SConfig(**fields)


@PROPERTY
@given(configs())
def test_flag_round_trip(config):
    argv = []
    for name, value in config.to_dict().items():
        if name in ("full_logits", "chunked_logits", "dry_run"):
            argv += [f"--d3s.{name}"] if value else []
        elif value is not None:
            argv += [f"--d3s.{name}", repr(value) if isinstance(value, float) else str(value)]
    parsed = vars(parser_with_flags().parse_args(argv))
    restored = D3SConfig.from_flags({key: value for key, value in parsed.items() if key.startswith("d3s.")})
    assert restored == config


def test_add_arguments_leaves_the_parser_usable_and_returns_its_group():
    parser = argparse.ArgumentParser()
    group = D3SConfig.add_arguments(parser)
    assert group in parser._action_groups
    assert len(group._group_actions) == len(FIELDS)
