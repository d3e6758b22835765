"""integration/swaps.py: which of upstream's module globals a run swaps, and for what (the entrypoint's tests in
tests/cli run them through upstream's own ``__main__``; tests/integration/test_integration_driver_watch.py runs the
driver's watch)."""

import argparse

import openrlhf.trainer.ppo_trainer as ppo_trainer
import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
import openrlhf.trainer.ray as trainer_ray
import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
import openrlhf.utils.config as host_config
import pytest
import ray

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration import swaps
from d3s_openrlhf.integration.actor import D3SPolicyModelActor, D3SReferenceModelActor
from d3s_openrlhf.integration.driver_watch import DriverWatch
from d3s_openrlhf.integration.eval_metrics import PassAtKPPOTrainer, PassAtKPPOTrainerAsync
from d3s_openrlhf.integration.lora_sync import LoRASyncPolicyModelActor
from d3s_openrlhf.integration.trainer import D3SPPOTrainer, D3SPPOTrainerAsync

PASS_AT_K = [
    (ppo_trainer, {"PPOTrainer": PassAtKPPOTrainer}),
    (ppo_trainer_async, {"PPOTrainerAsync": PassAtKPPOTrainerAsync}),
]


def without_the_driver_watch(run_swaps, engine_gap):
    """The swaps before the last three, once these are checked to be one fresh driver watch's (with ``engine_gap``
    over engines that report their log-probs: ``engine_gap.engines_reporting_logprobs``)."""
    *classes, (get_owner, get), (engines_owner, engines), (groups_owner, groups) = run_swaps
    assert (get_owner, engines_owner, groups_owner) == (ray, trainer_ray, launcher)
    watch = get["get"].__self__
    assert isinstance(watch, DriverWatch) and groups["RayActorGroup"].__self__ is watch
    watched = engines["create_vllm_engines"].__wrapped__
    if engine_gap:
        assert watched is not trainer_ray.create_vllm_engines
        watched = watched.__wrapped__
    assert watched is trainer_ray.create_vllm_engines
    return classes


@pytest.mark.parametrize("lora", [False, True])
def test_d3s_off_swaps_the_pass_at_k_trainers_and_under_lora_the_merged_sync(lora):
    expected = PASS_AT_K + ([(ppo_actor, {"PolicyModelActor": LoRASyncPolicyModelActor})] if lora else [])
    run_swaps = swaps.swaps_for_run(D3SConfig.from_flags({"preset": "grpo"}), lora, engine_gap=lora)
    assert without_the_driver_watch(run_swaps, lora) == expected
    assert without_the_driver_watch(swaps.swaps_for_run(D3SConfig(), lora), False) == expected  # an agent: no gap


@pytest.mark.parametrize("lora", [False, True])
def test_d3s_on_swaps_the_d3s_classes_and_attaches_the_config(lora):
    config = D3SConfig.from_flags({"preset": "d3s", "n_final": 16})
    (hierarchize_swap, *classes) = without_the_driver_watch(swaps.swaps_for_run(config, lora, lora), lora)
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


def test_each_run_has_a_watch_of_its_own():
    config = D3SConfig.from_flags({"preset": "grpo"})
    first, second = (swaps.swaps_for_run(config, False)[-3][1]["get"].__self__ for _ in range(2))
    assert first is not second
