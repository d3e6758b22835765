"""D3S trainers: OpenRLHF's ``PPOTrainer`` (sync) and ``PPOTrainerAsync`` with the D3S experience maker.

Both OpenRLHF trainers are ``@ray.remote`` classes, so we subclass their ``__ray_actor_class__`` and wrap the
subclass with ``ray.remote`` again (the wrapped classes are what ``openrlhf.cli.train_ppo_ray`` instantiates
once the entrypoint has swapped them in).

Every training step (``train_step``, shared by both modes through ``D3STrainerMixin``):

* (N, K) = ``DownSamplingSchedule.at(global_step)``; the horizon is ``--d3s.schedule_steps`` or else the run's
  number of rollout steps R, ceil(prompts / rollout.batch_size) * num_episodes, so the run's last step (global
  step R - 1) trains the final point. The global step is the one OpenRLHF restores from its checkpoint, so a
  resumed run continues the schedule where it stopped.
* The ``d3s/*`` metrics of the experience maker are merged into the step's status, which OpenRLHF prints and
  hands to its wandb / tensorboard loggers.
* The rollout statistics (``rollout/*``) describe all B*G rollouts of the step's batch, not only the kept ones:
  the groups the step trains, whose rollouts sample selection may drop (not the groups dynamic filtering dropped
  before the batch; docs/metrics.md).
* ``kl_ctl.update`` receives the number of rollouts actually trained instead of the nominal B*G.

Evaluation during training (``--eval.dataset``) logs upstream's metrics plus the unbiased
``eval/<datasource>/pass@k``: the sync trainer and the async generator actor derive from the pass@k seams of
``integration/eval_metrics.py``.

``get_max_steps`` (what ``openrlhf.cli.train_ppo_ray`` builds the actors' LR scheduler with) counts the optimizer
steps of the kept rollouts over the run's exact rollout steps (``host.scaled_max_steps``), so the LR schedule
still ends with training.

The async trainer builds its ``TrainingActor`` and ``GenerateSamplesActor`` inside ``PPOTrainerAsync.__init__``
from module globals of ``openrlhf.trainer.ppo_trainer_async``; ``D3SPPOTrainerAsync`` points those two globals
at the D3S subclasses for the duration of that constructor (in its own Ray worker process) and restores them.
"""

from __future__ import annotations

import inspect
from typing import Dict, Tuple

import ray
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ppo_trainer_async import (
    GenerateSamplesActor,
    PPOTrainerAsync,
    TrainingActor,
)

from d3s_openrlhf.integration.eval_metrics import PassAtKGenerateSamplesActorBase, PassAtKPPOTrainerBase
from d3s_openrlhf.integration.experience_maker import D3SExperienceMaker
from d3s_openrlhf.integration.host import config_from_args, rollout_steps, scaled_max_steps
from d3s_openrlhf.integration.liveness import TRAINING, WatchingRay, engine_names
from d3s_openrlhf.integration.samples_generator import STATE_KEY as GENERATION_STATE_KEY
from d3s_openrlhf.integration.samples_generator import D3SSamplesGenerator
from d3s_openrlhf.integration.seams import remote_like, swapped_globals


class _KeptCountKLController:
    """The trainer's KL controller, with ``update`` told the number of rollouts trained rather than B*G."""

    def __init__(self, inner, trained_rollouts):
        self.inner = inner
        self.trained_rollouts = trained_rollouts

    @property
    def value(self):
        return self.inner.value

    def update(self, current, n_steps):
        trained = self.trained_rollouts()
        self.inner.update(current, int(trained) if trained is not None else n_steps)


class D3STrainerMixin:
    """Shared D3S behaviour of the sync trainer and the async training actor (put first in the bases)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.d3s = config_from_args(self.args)
        if self.d3s is None:
            raise ValueError("the D3S trainers need the D3S config in the host args (args.d3s)")
        self.kl_ctl = _KeptCountKLController(
            self.kl_ctl, lambda: self.experience_maker.last_metrics.get("d3s/kept_rollouts")
        )
        self.experience_maker = D3SExperienceMaker(
            self.actor_model_group,
            self.critic_model_group,
            self.reward_model_group,
            self.reference_model_group,
            self.kl_ctl,
            self.strategy,
            self.tokenizer,
            d3s_config=self.d3s,
        )
        self.d3s_rollout_steps = None

    def set_d3s_rollout_steps(self, steps: int) -> None:
        """The run's number of rollout steps (the schedule's horizon unless ``--d3s.schedule_steps`` is set)."""
        self.d3s_rollout_steps = int(steps)

    def d3s_schedule_point(self, global_step: int) -> Tuple[int, float]:
        if self.d3s.schedule_steps <= 0 and self.d3s_rollout_steps is None:
            raise RuntimeError("the D3S schedule horizon is unknown: set_d3s_rollout_steps was never called")
        schedule = self.d3s.schedule_for(self.d3s_rollout_steps or 1)
        n, k = schedule.at(global_step)
        if not self.d3s.samples_enabled:
            n = self.args.rollout.n_samples_per_prompt
        return n, k

    def train_step(self, rollout_samples, global_step: int) -> Tuple[Dict, int]:
        n, k = self.d3s_schedule_point(global_step)
        self.experience_maker.set_schedule_point(global_step, n, k)
        status, next_step = super().train_step(rollout_samples, global_step)
        status.update(self.experience_maker.last_metrics)
        return status, next_step

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        # the generator's metrics of this batch travel in the dataloader state it was drawn with (sync and async)
        generation = (client_states or {}).get("data_loader_state_dict", {}).get(GENERATION_STATE_KEY)
        if generation is not None and logs_dict is not None:
            logs_dict.update(generation["metrics"])
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    def _compute_rollout_stats(self, experiences) -> Dict:
        # The experiences hold the kept rollouts only; the statistics describe all B*G rollouts of the batch.
        all_rollouts = self.experience_maker.last_rollouts
        return super()._compute_rollout_stats(all_rollouts if all_rollouts is not None else experiences)


class _D3SPPOTrainer(D3STrainerMixin, PassAtKPPOTrainerBase):
    """Sync trainer: the D3S samples generator; the horizon comes from its own prompt dataloader."""

    samples_generator_class = D3SSamplesGenerator

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # checkpoints save and restore the generator's dataloader, whose state carries the generation level's
        self.prompts_dataloader = self.samples_generator.prompts_dataloader
        self.set_d3s_rollout_steps(rollout_steps(len(self.prompts_dataloader), self.args))

    def get_max_steps(self):
        # the LR-scheduler horizon openrlhf.cli.train_ppo_ray builds the actors with
        return scaled_max_steps(self.args, self.d3s, super().get_max_steps(), self.d3s_rollout_steps)

    def fit(self, global_step: int = 0) -> None:
        # a dead engine fails generation's own waits, but not the weight sync's: the policy actors block sending to
        # it; every wait of upstream's loop watches the engines (integration/liveness.py)
        upstream = super().fit
        with swapped_globals(upstream.__func__, ray=WatchingRay(engine_names(self.vllm_engines), TRAINING)):
            upstream(global_step)


class _D3STrainingActor(D3STrainerMixin, TrainingActor.__ray_actor_class__):
    """Async training actor: the horizon is set by ``D3SPPOTrainerAsync`` from the generator actor."""

    def broadcast_to_vllm(self):
        # Ray ships the methods of upstream's @ray.remote classes by value: the copy it installs on the actor
        # binds zero-argument super() to a copy of TrainingActor that is not in this class's MRO (TypeError at
        # the first weight sync). Entering through this importable method resolves the imported class instead.
        super().broadcast_to_vllm()


class _D3SGenerateSamplesActor(PassAtKGenerateSamplesActorBase):
    """Async generator actor with the D3S samples generator, which can report the run's number of rollout steps."""

    samples_generator_class = D3SSamplesGenerator

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts_dataloader = self.samples_generator.prompts_dataloader

    def d3s_rollout_steps(self) -> int:
        return rollout_steps(len(self.prompts_dataloader), self.args)

    def get_max_steps(self):
        # PPOTrainerAsync.get_max_steps asks this actor for the LR-scheduler horizon of the actors
        config = config_from_args(self.args)
        return scaled_max_steps(self.args, config, super().get_max_steps(), self.d3s_rollout_steps())


D3SPPOTrainer = remote_like(PPOTrainer, _D3SPPOTrainer)
D3STrainingActor = remote_like(TrainingActor, _D3STrainingActor)
D3SGenerateSamplesActor = remote_like(GenerateSamplesActor, _D3SGenerateSamplesActor)


class _D3SPPOTrainerAsync(PPOTrainerAsync.__ray_actor_class__):
    """Async trainer whose generator and training actors are the D3S ones, and whose wait on them watches them and
    the engines."""

    def __init__(self, *args, **kwargs):
        upstream_init = super().__init__
        with swapped_globals(
            upstream_init.__func__, TrainingActor=D3STrainingActor, GenerateSamplesActor=D3SGenerateSamplesActor
        ):
            upstream_init(*args, **kwargs)
        self.d3s_vllm_engines = inspect.signature(upstream_init).bind(*args, **kwargs).arguments["vllm_engines"]
        steps = ray.get(self.generator_actor.d3s_rollout_steps.remote())
        ray.get(self.trainer_actor.set_d3s_rollout_steps.remote(steps))

    def fit(self) -> None:
        # the generator and training actors wait on each other through queues and a lock: one blocked by a dead
        # engine (the weight sync to it) or a dead peer blocks the other, and upstream's ray.get on both for ever
        actors = {"the generator actor": self.generator_actor, "the training actor": self.trainer_actor}
        upstream = super().fit
        with swapped_globals(
            upstream.__func__, ray=WatchingRay({**actors, **engine_names(self.d3s_vllm_engines)}, TRAINING)
        ):
            upstream()


D3SPPOTrainerAsync = remote_like(PPOTrainerAsync, _D3SPPOTrainerAsync)
