"""Every refusal of ``python -m d3s_openrlhf.cli.evaluate`` happens before any model loads, and names the flag or
the line to change."""

import json
import os
import shutil

import pytest

from d3s_openrlhf.cli import evaluate as cli
from d3s_openrlhf.evaluation import inputs, runner


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the evaluation started although the arguments are refused")

    monkeypatch.setattr(runner, "evaluate", fail)


def refusal(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_k_above_n(eval_inputs, eval_argv, tmp_path, no_model_load, capsys):
    err = refusal(eval_argv(tmp_path / "out") + ["--k", "1", "8"], capsys)
    assert "--k 1 8 with --n 4" in err and "k = [8] outside [1, n = 4]" in err
    assert not (tmp_path / "out").exists()


def test_empty_data_file(eval_inputs, eval_argv, tmp_path, no_model_load, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    err = refusal(eval_argv(tmp_path / "out") + ["--data", str(empty)], capsys)
    assert f"--data {empty}: empty data file" in err


@pytest.mark.parametrize("key, flag", [("prompt", "--input_key"), ("label", "--label_key")])
def test_missing_key_names_the_line(eval_inputs, eval_argv, tmp_path, no_model_load, capsys, key, flag):
    rows = [dict(row) for row in eval_inputs["rows"][:3]]
    del rows[1][key]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    err = refusal(eval_argv(tmp_path / "out") + ["--data", str(data)], capsys)
    assert f"--data {data} line 2: no '{key}' key ({flag} {key})" in err


def test_other_key_names(eval_inputs, eval_argv, tmp_path, no_model_load, capsys):
    err = refusal(eval_argv(tmp_path / "out") + ["--input_key", "question"], capsys)
    assert "line 1: no 'question' key (--input_key question)" in err


def test_missing_reward_file(eval_inputs, eval_argv, tmp_path, no_model_load, capsys):
    missing = tmp_path / "nowhere.py"
    err = refusal(eval_argv(tmp_path / "out") + ["--reward", str(missing)], capsys)
    assert f"--reward {missing}: no such file" in err


def test_reward_file_without_reward_func(eval_inputs, eval_argv, tmp_path, no_model_load, capsys):
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    err = refusal(eval_argv(tmp_path / "out") + ["--reward", str(other)], capsys)
    assert "defines no reward_func" in err


@pytest.mark.parametrize("weights", ["none", "missing_dir"])
def test_model_dir_without_weights(eval_inputs, eval_argv, tmp_path, no_model_load, capsys, weights):
    model = tmp_path / "model"
    if weights == "none":
        shutil.copytree(eval_inputs["model"], model, ignore=shutil.ignore_patterns("*.safetensors"))
    err = refusal(eval_argv(tmp_path / "out") + ["--model", str(model)], capsys)
    expected = "no weights in the directory" if weights == "none" else "not a directory"
    assert f"--model {model}: {expected}" in err


@pytest.mark.parametrize("twice", ["model/", "./model", "{abs}"])
def test_a_model_given_twice_however_spelt_is_refused(
    eval_inputs, eval_argv, tmp_path, no_model_load, capsys, monkeypatch, twice
):
    monkeypatch.chdir(os.path.dirname(eval_inputs["model"]))
    twice = twice.format(abs=eval_inputs["model"])
    err = refusal(eval_argv(tmp_path / "out") + ["--model", "model", twice], capsys)
    assert f"--model: {twice} is model again" in err


def test_other_settings_are_refused(eval_inputs, eval_argv, tmp_path, no_model_load, capsys):
    out = tmp_path / "out"
    options = cli.parse(eval_argv(out))
    inputs.claim_output_dir(str(out), inputs.sample_settings(options))
    err = refusal(eval_argv(out) + ["--n", "8", "--temperature", "0.5"], capsys)
    assert "--n: was 4, now 8" in err and "--temperature: was 1.0, now 0.5" in err
    # the same settings (and another --k: the samples are the same) are accepted by the guard
    inputs.claim_output_dir(str(out), inputs.sample_settings(cli.parse(eval_argv(out) + ["--k", "1"])))
