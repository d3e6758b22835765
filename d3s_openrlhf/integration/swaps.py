"""Every swap of upstream's module globals under which ``openrlhf.cli.train_ppo_ray`` runs our classes.

A swap is a pair (module, {global name: replacement}); ``host.run_upstream_main`` puts them in place for the
duration of upstream's ``__main__`` (``seams.swapped_globals``). :func:`swaps_for_run` picks the set of a run:

* D3S on (:func:`d3s_swaps`): the D3S policy and reference actors, the D3S trainers (sync and async), and
  ``hierarchize`` wrapped to attach the resolved config to the args as ``args.d3s`` (a namespace of the
  ``D3SConfig`` fields, ``host.config_namespace``), so every Ray worker sees ``strategy.args.d3s``.
* D3S off (:func:`pass_at_k_swaps`): the trainers whose evaluation adds the unbiased ``eval/<ds>/pass@k``
  (``eval_metrics``), for the comparison with a D3S run; under LoRA also :func:`lora_swaps`, the policy actor with
  the merged LoRA weight sync (``lora_sync``: upstream's cannot send adapters to vLLM).
* Both (:func:`liveness_swaps`, last): the driver's ``ray.get`` watches the engines and the model actors from their
  creation on, so that a death at any point ends the run (``driver_watch``); under LoRA (without an agent) the engines
  it creates report the log-probs of what they sample, for the engine's gap (``engine_gap``).
"""

from __future__ import annotations

from typing import Mapping, Tuple

import openrlhf.trainer.ppo_trainer as ppo_trainer
import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
import openrlhf.trainer.ray as trainer_ray
import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
import openrlhf.utils.config as host_config
import ray

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration import host
from d3s_openrlhf.integration.actor import D3SPolicyModelActor, D3SReferenceModelActor
from d3s_openrlhf.integration.driver_watch import DriverWatch
from d3s_openrlhf.integration.engine_gap import engines_reporting_logprobs
from d3s_openrlhf.integration.eval_metrics import PassAtKPPOTrainer, PassAtKPPOTrainerAsync
from d3s_openrlhf.integration.lora_sync import LoRASyncPolicyModelActor
from d3s_openrlhf.integration.trainer import D3SPPOTrainer, D3SPPOTrainerAsync

Swap = Tuple[object, Mapping[str, object]]


def d3s_swaps(config: D3SConfig) -> Tuple[Swap, ...]:
    """The swaps under which upstream's ``train_ppo_ray`` builds the D3S actors, trainers and ``args.d3s``."""
    upstream_hierarchize = host_config.hierarchize

    def hierarchize_with_d3s(args):
        hierarchized = upstream_hierarchize(args)
        hierarchized.d3s = host.config_namespace(config)
        return hierarchized

    return (
        (host_config, {"hierarchize": hierarchize_with_d3s}),
        (ppo_actor, {"PolicyModelActor": D3SPolicyModelActor}),
        (launcher, {"ReferenceModelActor": D3SReferenceModelActor}),
        (ppo_trainer, {"PPOTrainer": D3SPPOTrainer}),
        (ppo_trainer_async, {"PPOTrainerAsync": D3SPPOTrainerAsync}),
    )


def pass_at_k_swaps() -> Tuple[Swap, ...]:
    """The swaps under which upstream's ``train_ppo_ray``, D3S off, builds trainers whose evaluation adds the
    unbiased pass@k."""
    return (
        (ppo_trainer, {"PPOTrainer": PassAtKPPOTrainer}),
        (ppo_trainer_async, {"PPOTrainerAsync": PassAtKPPOTrainerAsync}),
    )


def lora_swaps() -> Tuple[Swap, ...]:
    """The swap under which upstream's ``train_ppo_ray`` syncs merged LoRA weights."""
    return ((ppo_actor, {"PolicyModelActor": LoRASyncPolicyModelActor}),)


def liveness_swaps(create_vllm_engines) -> Tuple[Swap, ...]:
    """The swaps under which every wait of upstream's driver watches the engines and the model actors (a fresh
    ``DriverWatch``: the actors of this run): ``ray.get`` itself (upstream's ``train()`` reads the ``ray`` module
    from a namespace of its own), the engines' creation (by ``create_vllm_engines``) and the model-actor groups."""
    watch = DriverWatch()
    return (
        (ray, {"get": watch.get}),
        (trainer_ray, {"create_vllm_engines": watch.watching_engines(create_vllm_engines)}),
        (launcher, {"RayActorGroup": watch.actor_group}),
    )


def swaps_for_run(config: D3SConfig, lora: bool, engine_gap: bool = False) -> Tuple[Swap, ...]:
    """The swaps of a run: the D3S classes when D3S is on; with D3S off the pass@k evaluation and, under LoRA
    (``lora``), the merged LoRA weight sync (the D3S actor trainer has that sync built in); the driver's watch in
    both, over engines that report their log-probs when the run logs the engine's gap (``engine_gap``:
    ``host.engine_gap_logged``)."""
    engines = trainer_ray.create_vllm_engines
    watched = liveness_swaps(engines_reporting_logprobs(engines) if engine_gap else engines)
    if config.enabled:
        return d3s_swaps(config) + watched
    return pass_at_k_swaps() + (lora_swaps() if lora else ()) + watched
