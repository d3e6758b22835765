"""The driver's waits, watched from ``ray.init`` to the final save (``liveness.py``).

Upstream's driver (``train()`` of ``openrlhf.cli.train_ppo_ray``) creates the vLLM engines and the model actors,
then waits in plain ``ray.get``: on the trainer's construction, on the models' loading (during which policy rank 0
forms the weight-sync group with the engines: a dead engine leaves it in the rendezvous for PyTorch's 30 minutes),
on the trainer's ``fit`` and on the final save. ``runpy`` runs that module in a fresh namespace, so the ``ray`` it
reads cannot be swapped; ``ray.get`` itself is, in the driver's process and for the run only
(``swaps.liveness_swaps``): :class:`DriverWatch`, which watches every engine and model actor from its creation on
(through ``create_vllm_engines`` and :class:`WatchedActorGroup`) and names the phase the run is in.
"""

from __future__ import annotations

import functools

from openrlhf.trainer.ray.launcher import RayActorGroup, ReferenceModelActor, RewardModelActor
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
from openrlhf.trainer.ray.ppo_critic import CriticModelActor

from d3s_openrlhf.integration.liveness import FINAL_SAVE, MODELS_LOADING, STARTUP, TRAINING, WatchingRay, engine_names

# upstream's classes (imported before any swap): the D3S and LoRA actors derive from them
ROLES = (
    (PolicyModelActor, "policy"),
    (ReferenceModelActor, "reference"),
    (RewardModelActor, "reward"),
    (CriticModelActor, "critic"),
)


def role(actor_type) -> str:
    """``policy``, ``reference``, ``reward`` or ``critic`` for a model-actor class (its class name otherwise)."""
    cls = actor_type.__ray_actor_class__
    return next((name for upstream, name in ROLES if issubclass(cls, upstream.__ray_actor_class__)), cls.__name__)


class DriverWatch(WatchingRay):
    """``ray.get`` of the driver for the run: it watches the actors added as they are created, and names the phase
    the seams set (start-up, the models' loading, training, the final save)."""

    def __init__(self) -> None:
        super().__init__(phase=STARTUP)

    def get(self, refs, *, timeout=None, **kwargs):
        values = super().get(refs, timeout=timeout, **kwargs)
        if self.phase == MODELS_LOADING:
            # once the models are loaded (the critic's, after the others', marks its loading again), train() waits
            # on the trainer's fit alone until the final save
            self.phase = TRAINING
        return values

    def watching_engines(self, create_vllm_engines):
        """Upstream's ``create_vllm_engines``, whose engines this watch watches from their creation on."""

        @functools.wraps(create_vllm_engines)
        def create(*args, **kwargs):
            engines = create_vllm_engines(*args, **kwargs)
            self.watch(engine_names(engines))
            return engines

        return create

    def actor_group(self, *args, **kwargs) -> WatchedActorGroup:
        """``RayActorGroup(...)`` as train() calls it: a group whose actors this watch watches."""
        return WatchedActorGroup(self, *args, **kwargs)


class WatchedActorGroup(RayActorGroup):
    """Upstream's group of model actors, built by the driver: its actors are watched from their creation on, and
    the driver's waits on their loading and final save name those phases."""

    def __init__(self, watch: DriverWatch, *args, **kwargs) -> None:
        self._watch = watch
        super().__init__(*args, **kwargs)
        name = role(self.ray_actor_type)
        watch.watch({f"{name} model actor {rank}": actor for rank, actor in enumerate(self._actor_handlers)})

    def async_init_model_from_pretrained(self, *args, **kwargs):
        self._watch.phase = MODELS_LOADING
        return super().async_init_model_from_pretrained(*args, **kwargs)

    def async_save_model(self):
        self._watch.phase = FINAL_SAVE
        return super().async_save_model()

    def __reduce__(self):
        # the group travels to the trainer actor as upstream's own: the watch is the driver's (the trainer's waits
        # have theirs). Rebuilt by a module function: while the run's swap holds, launcher.RayActorGroup is the
        # watch's factory, so the class itself would be pickled by value
        return _upstream_group, ({key: value for key, value in vars(self).items() if key != "_watch"},)


def _upstream_group(state) -> RayActorGroup:
    """Upstream's group with ``state`` (:meth:`WatchedActorGroup.__reduce__`)."""
    group = RayActorGroup.__new__(RayActorGroup)
    group.__dict__.update(state)
    return group
