"""Waiting on Ray results without hanging on a dead actor.

OpenRLHF waits with plain ``ray.get``. A dead actor fails only the results it was to produce itself, so a wait on
another actor that waits for it never ends: when a vLLM engine dies (an OOM kill) while the policy actors send it
weights, rank 0 blocks in the broadcast to it and the other ranks in the barrier after, and the trainer's
``ray.get`` on them waits for ever; in async mode the generator then waits for the trainer's lock and slots, and
so does the whole job. At start-up, an engine that dies while vLLM loads leaves policy rank 0 in the weight-sync
group's rendezvous (PyTorch's 30-minute timeout) and the driver's ``ray.get`` on the models' loading as long.

:func:`watched_get` is ``ray.get`` that also watches named actors: each holds one pending ping
(``__ray_ready__``, which Ray's actors answer between tasks, and an async actor such as a vLLM engine at once),
sent once the wait has lasted :data:`PING_INTERVAL_S` and renewed as often (a quick wait sends none); a dead
actor fails its ping as soon as Ray knows of the death, and the wait ends with :class:`DeadActorError` naming
the actor, the phase of the run and Ray's account of what killed it. A result that fails ends the wait at once
too, whichever its position in the list (named as a watched actor's death when that actor's death is the cause).
:class:`WatchingRay` puts it in the place of the ``ray`` module an upstream method reads
(``seams.swapped_globals``); actors can be added to its watch as they are created.

Who watches what: the driver, every wait from ``ray.init`` to the final save, over the engines and the model
actors from their creation on (``driver_watch.py``); the D3S trainers, their ``fit``, over the engines and in
async mode the generator and training actors (``trainer.py``).
"""

from __future__ import annotations

import time
from typing import Dict, Mapping, Optional

import ray
from ray.exceptions import RayActorError

PING_INTERVAL_S = 5.0  # a death is seen within about this long; an idle actor answers one ping per interval

# the phases of a run a death is reported in (the driver's watch moves through them; the trainers' is in TRAINING)
STARTUP = "start-up"
MODELS_LOADING = "start-up (the models' loading, in which policy rank 0 forms the weight-sync group with the engines)"
TRAINING = "training"
FINAL_SAVE = "the final save"

# Ray's own get: in the driver, ``ray.get`` itself is a watch for the run (driver_watch.py), which waits with this
_ray_get = ray.get


class DeadActorError(RuntimeError):
    """A watched actor died while the trainer waited on Ray results."""

    def __init__(self, name: str, cause: BaseException, phase: Optional[str] = None) -> None:
        during = f" during {phase}" if phase else ""
        super().__init__(
            f"{name} died{during}, so the run stops (its checkpoints are kept for a resume). Ray says: {cause}"
        )
        self.actor_name, self.phase = name, phase


def engine_names(engines) -> Dict[str, object]:
    """``{"vLLM engine i": handle}`` of upstream's list of engine actors (None without vLLM)."""
    return {f"vLLM engine {index}": engine for index, engine in enumerate(engines or [])}


def watched_get(refs, actors: Mapping[str, object], timeout=None, phase: Optional[str] = None, **kwargs):
    """``ray.get(refs, timeout=timeout)``, raising :class:`DeadActorError` (naming ``phase``, what the run was doing)
    once one of ``actors`` (name -> actor handle) is dead, and the error of any of ``refs`` as soon as it fails.
    Anything but an ObjectRef or a list or tuple of them (and Ray's other keywords) goes to Ray's own get."""
    watchable = isinstance(refs, ray.ObjectRef) or (
        isinstance(refs, (list, tuple)) and all(isinstance(ref, ray.ObjectRef) for ref in refs)
    )
    if not actors or not watchable or kwargs:
        return _ray_get(refs, timeout=timeout, **kwargs)
    single = isinstance(refs, ray.ObjectRef)
    pending = set([refs] if single else refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    pings, last_ping = {}, dict.fromkeys(actors, time.monotonic())
    while pending:
        now = time.monotonic()
        for name, actor in actors.items():
            if name not in pings.values() and now - last_ping[name] >= PING_INTERVAL_S:
                pings[actor.__ray_ready__.remote()] = name
                last_ping[name] = now
        wait_s = PING_INTERVAL_S if deadline is None else max(0.0, min(PING_INTERVAL_S, deadline - now))
        ready, _ = ray.wait([*pending, *pings], num_returns=1, timeout=wait_s)
        for ref in ready:
            try:
                _ray_get(ref)  # a failed result raises its error now
            except RayActorError as error:
                name = pings.get(ref) or _watched_name(error, actors)
                if name is None:
                    raise
                raise DeadActorError(name, error, phase) from error
            pings.pop(ref, None)
            pending.discard(ref)
        if deadline is not None and time.monotonic() >= deadline and pending:
            break  # ray.get below raises its own GetTimeoutError
    return _ray_get(refs, timeout=0 if timeout is not None else None)


def _watched_name(error: RayActorError, actors: Mapping[str, object]) -> Optional[str]:
    """The name of the watched actor whose death ``error`` reports (a result of that actor, or of a task that
    called it), or None."""
    dead = getattr(error, "actor_id", None)  # a task's error that wraps an actor's death may lack it
    return next((name for name, actor in actors.items() if dead and actor._actor_id.hex() == dead), None)


class WatchingRay:
    """The ``ray`` module as an upstream method sees it, with ``get`` watching ``actors`` (:func:`watched_get`) and
    naming ``phase`` in its error; :meth:`watch` adds actors."""

    def __init__(self, actors: Optional[Mapping[str, object]] = None, phase: Optional[str] = None) -> None:
        self._actors = dict(actors or {})
        self.phase = phase

    def watch(self, actors: Mapping[str, object]) -> None:
        self._actors.update(actors)

    def get(self, refs, *, timeout=None, **kwargs):
        return watched_get(refs, dict(self._actors), timeout=timeout, phase=self.phase, **kwargs)

    def __getattr__(self, name):
        return getattr(ray, name)
