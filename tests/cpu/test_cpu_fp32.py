"""The CPU runtime's float32 mode (``--fp32`` / ``D3S_OPENRLHF_CPU_FP32=1``): OpenRLHF's own model loader and
DeepSpeed configs give float32 for the ``--ds.param_dtype`` they are handed, and only when asked. Each case runs
in a fresh interpreter: the adjustments replace module attributes once per process, as in a Ray worker."""

import json
import os
import subprocess
import sys

import pytest

from d3s_openrlhf.cpu import precision
from d3s_openrlhf.testbed import toy

PROBE = """
import json, sys
import torch
from d3s_openrlhf.cpu import patches
patches.apply()
from openrlhf.models import Actor
from openrlhf.utils.deepspeed import deepspeed as strategy_module
from openrlhf.utils.utils import convert_to_torch_dtype

configs = {
    name: getattr(strategy_module, name)(offload=False, param_dtype="bf16")
    for name in ("get_train_ds_config", "get_eval_ds_config")
}
actor = Actor(sys.argv[1], attn_implementation="eager", param_dtype="bf16")
print(json.dumps({
    "dtype": str(convert_to_torch_dtype("bf16")),
    "actor": str(next(actor.model.parameters()).dtype),
    "ds": {name: [config["bf16"]["enabled"], config["fp16"]["enabled"]] for name, config in configs.items()},
}))
"""


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return toy.save_model_and_tokenizer(str(tmp_path_factory.mktemp("model")))


def probe(model, fp32):
    env = {key: value for key, value in os.environ.items() if key != precision.FP32_ENV}
    if fp32 is not None:
        env[precision.FP32_ENV] = fp32
    result = subprocess.run([sys.executable, "-c", PROBE, model], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fp32", [None, "0"])
def test_without_the_switch_upstreams_bf16_is_untouched(bf16_model, fp32):
    report = probe(bf16_model, fp32)
    assert report == {
        "dtype": "torch.bfloat16",
        "actor": "torch.bfloat16",
        "ds": {"get_train_ds_config": [True, False], "get_eval_ds_config": [True, False]},
    }


def test_the_switch_gives_float32_models_and_deepspeeds_fp32_engine(bf16_model):
    report = probe(bf16_model, "1")
    assert report == {
        "dtype": "torch.float32",
        "actor": "torch.float32",  # the checkpoint is bf16: the loader casts it
        "ds": {"get_train_ds_config": [False, False], "get_eval_ds_config": [False, False]},
    }


@pytest.mark.parametrize("value", ["yes", "true", " 1"])
def test_other_values_are_refused_by_the_launcher_before_ray(value):
    env = {**os.environ, precision.FP32_ENV: value}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "d3s_openrlhf.cli.cpu", "openrlhf.cli.train_ppo_ray", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert f"{precision.FP32_ENV}={value!r}: set it to 1" in result.stderr  # before the head would start


def test_the_launcher_flag_reaches_the_command():
    from d3s_openrlhf.testbed import pipeline

    command = pipeline.launcher_command("openrlhf.cli.train_sft", ["--x", 1], fp32=True)
    assert command[1:] == ["-m", "d3s_openrlhf.cli.cpu", "--fp32", "openrlhf.cli.train_sft", "--x", "1"]
    assert "--fp32" not in pipeline.launcher_command("openrlhf.cli.train_sft", [])
