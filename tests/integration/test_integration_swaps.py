"""integration/swaps.py: which of upstream's module globals a run swaps, and for what (the entrypoint's tests in
tests/cli run them through upstream's own ``__main__``)."""

import argparse

import openrlhf.trainer.ppo_trainer as ppo_trainer
import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
import openrlhf.utils.config as host_config
import pytest

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration import swaps
from d3s_openrlhf.integration.actor import D3SPolicyModelActor, D3SReferenceModelActor
from d3s_openrlhf.integration.eval_metrics import PassAtKPPOTrainer, PassAtKPPOTrainerAsync
from d3s_openrlhf.integration.lora_sync import LoRASyncPolicyModelActor
from d3s_openrlhf.integration.trainer import D3SPPOTrainer, D3SPPOTrainerAsync

PASS_AT_K = [
    (ppo_trainer, {"PPOTrainer": PassAtKPPOTrainer}),
    (ppo_trainer_async, {"PPOTrainerAsync": PassAtKPPOTrainerAsync}),
]


@pytest.mark.parametrize("lora", [False, True])
def test_d3s_off_swaps_the_pass_at_k_trainers_and_under_lora_the_merged_sync(lora):
    expected = PASS_AT_K + ([(ppo_actor, {"PolicyModelActor": LoRASyncPolicyModelActor})] if lora else [])
    assert list(swaps.swaps_for_run(D3SConfig.from_flags({"preset": "grpo"}), lora)) == expected


@pytest.mark.parametrize("lora", [False, True])
def test_d3s_on_swaps_the_d3s_classes_and_attaches_the_config(lora):
    config = D3SConfig.from_flags({"preset": "d3s", "n_final": 16})
    (hierarchize_swap, *classes) = swaps.swaps_for_run(config, lora)
    assert classes == [
        (ppo_actor, {"PolicyModelActor": D3SPolicyModelActor}),
        (launcher, {"ReferenceModelActor": D3SReferenceModelActor}),
        (ppo_trainer, {"PPOTrainer": D3SPPOTrainer}),
        (ppo_trainer_async, {"PPOTrainerAsync": D3SPPOTrainerAsync}),
    ]
    owner, replacement = hierarchize_swap
    assert owner is host_config and set(replacement) == {"hierarchize"}
    args = replacement["hierarchize"](argparse.Namespace(**{"rollout.batch_size": 3}))
    assert args.rollout.batch_size == 3 and vars(args.d3s) == config.to_dict()
