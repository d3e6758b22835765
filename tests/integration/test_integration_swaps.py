"""integration/swaps.py: which of upstream's module globals a run swaps, and for what (the entrypoint's tests in
tests/cli run them through upstream's own ``__main__``; tests/integration/test_integration_driver_watch.py runs the
driver's watch)."""

import argparse

import openrlhf.trainer.ppo_trainer as ppo_trainer
import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
import openrlhf.trainer.ray as trainer_ray
import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
import openrlhf.trainer.ray.vllm_engine as vllm_engine
import openrlhf.utils.config as host_config
import pytest
import ray

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration import swaps
from d3s_openrlhf.integration.actor import D3SPolicyModelActor, D3SReferenceModelActor
from d3s_openrlhf.integration.driver_watch import DriverWatch
from d3s_openrlhf.integration.eval_metrics import PassAtKPPOTrainer, PassAtKPPOTrainerAsync
from d3s_openrlhf.integration.lora_engine import LoRAServing
from d3s_openrlhf.integration.lora_sync import LoRASyncPolicyModelActor
from d3s_openrlhf.integration.trainer import D3SPPOTrainer, D3SPPOTrainerAsync

PASS_AT_K = [
    (ppo_trainer, {"PPOTrainer": PassAtKPPOTrainer}),
    (ppo_trainer_async, {"PPOTrainerAsync": PassAtKPPOTrainerAsync}),
]


def without_the_driver_watch(run_swaps):
    """The swaps before the last three, once these are checked to be one fresh driver watch's."""
    *classes, (get_owner, get), (engines_owner, engines), (groups_owner, groups) = run_swaps
    assert (get_owner, engines_owner, groups_owner) == (ray, trainer_ray, launcher)
    watch = get["get"].__self__
    assert isinstance(watch, DriverWatch) and groups["RayActorGroup"].__self__ is watch
    assert engines["create_vllm_engines"].__wrapped__ is trainer_ray.create_vllm_engines
    return classes


def lora_engines(classes, rank):
    """``classes`` less their last swap, checked to be the engines that serve LoRA adapters up to vLLM's ``rank``."""
    *classes, (owner, replacement) = classes
    serving = replacement["RolloutRayActor"].__ray_actor_class__
    assert owner is vllm_engine and serving.__mro__[1:3] == (
        LoRAServing,
        vllm_engine.RolloutRayActor.__ray_actor_class__,
    )
    assert serving.max_lora_rank == rank
    return classes


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_d3s_off_swaps_the_pass_at_k_trainers_and_under_lora_the_adapter_sync(lora_rank):
    classes = without_the_driver_watch(swaps.swaps_for_run(D3SConfig.from_flags({"preset": "grpo"}), lora_rank))
    if lora_rank:
        classes = lora_engines(classes, 8)  # vLLM's next allowed max_lora_rank
    expected = PASS_AT_K + ([(ppo_actor, {"PolicyModelActor": LoRASyncPolicyModelActor})] if lora_rank else [])
    assert classes == expected


@pytest.mark.parametrize("lora_rank", [0, 64])
def test_d3s_on_swaps_the_d3s_classes_and_attaches_the_config(lora_rank):
    config = D3SConfig.from_flags({"preset": "d3s", "n_final": 16})
    (hierarchize_swap, *classes) = without_the_driver_watch(swaps.swaps_for_run(config, lora_rank))
    if lora_rank:  # the D3S actor trainer has the LoRA sync built in; the engines are swapped
        classes = lora_engines(classes, 64)
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
    first, second = (swaps.swaps_for_run(config, 0)[-3][1]["get"].__self__ for _ in range(2))
    assert first is not second
