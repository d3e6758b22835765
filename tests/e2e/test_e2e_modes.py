"""Real ``train_ppo_ray`` runs of the modes GPU users switch on for speed, with D3S, on the CPU runtime: sample
packing (flash-attention 2 on the CPU stand-in), dynamic batching, DAPO-style dynamic filtering and a
multi-turn agent. Same per-step assertions as tests/e2e/test_e2e_pipeline.py."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from d3s_openrlhf.cpu import pipeline

pytestmark = pytest.mark.e2e


def _pipeline_helpers():
    # TODO(lead): move d3s_flags / expected_schedule / assert_kept_counts into conftest.py and import them there
    path = Path(__file__).with_name("test_e2e_pipeline.py")
    spec = importlib.util.spec_from_file_location("_d3s_e2e_pipeline_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helpers = _pipeline_helpers()
BASE, STEPS = helpers.BASE, helpers.STEPS
CROSS = helpers.CROSS


def ppo_args(toy_sft, tmp_path, name, config):
    return pipeline.ppo_args(toy_sft.sft_model, toy_sft.task, str(tmp_path / name), config)


def test_packing_cross_scope(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    # --ds.packing_samples forces flash_attention_2: upstream's default attention, served by the CPU stand-in
    config = dataclasses.replace(
        BASE, extra=helpers.d3s_flags(**CROSS) + ["--ds.packing_samples", "--ds.attn_implementation", "flash_attention_2"]
    )
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "packing", config), name="packing")
    assert_clean_run(run, range(1, STEPS + 1))
    helpers.assert_kept_counts(run, helpers.expected_schedule(CROSS, config, STEPS))
