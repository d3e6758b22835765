"""Waiting on Ray results without hanging on a dead actor.

OpenRLHF's trainers wait with plain ``ray.get``. A dead actor fails only the results it was to produce itself, so a
wait on another actor that waits for it never ends: when a vLLM engine dies (an OOM kill) while the policy actors
send it weights, rank 0 blocks in the broadcast to it and the other ranks in the barrier after, and the trainer's
``ray.get`` on them waits for ever; in async mode the generator then waits for the trainer's lock and slots, and
so does the whole job.

:func:`watched_get` is ``ray.get`` that also watches named actors: each holds one pending ping
(``__ray_ready__``, which Ray's actors answer between tasks, and an async actor such as a vLLM engine at once),
sent once the wait has lasted :data:`PING_INTERVAL_S` and renewed as often (a quick wait sends none); a dead
actor fails its ping as soon as Ray knows of the death, and the wait ends with :class:`DeadActorError` naming
the actor and Ray's account of what killed it. A result that fails ends the wait at once too, whichever its
position in the list. :class:`WatchingRay` puts it in the place of the
``ray`` module an upstream method reads (``seams.swapped_globals``).
"""

from __future__ import annotations

import time
from typing import Dict, Mapping

import ray
from ray.exceptions import RayActorError

PING_INTERVAL_S = 5.0  # a death is seen within about this long; an idle actor answers one ping per interval


class DeadActorError(RuntimeError):
    """A watched actor died while the trainer waited on Ray results."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"{name} died, so the run stops (its checkpoints are kept for a resume). Ray says: {cause}")
        self.actor_name = name


def engine_names(engines) -> Dict[str, object]:
    """``{"vLLM engine i": handle}`` of upstream's list of engine actors (None without vLLM)."""
    return {f"vLLM engine {index}": engine for index, engine in enumerate(engines or [])}


def watched_get(refs, actors: Mapping[str, object], timeout=None):
    """``ray.get(refs, timeout=timeout)``, raising :class:`DeadActorError` once one of ``actors`` (name -> actor
    handle) is dead, and the error of any of ``refs`` as soon as it fails."""
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
            if ref in pings:
                name = pings.pop(ref)
                try:
                    ray.get(ref)
                except RayActorError as error:
                    raise DeadActorError(name, error) from error
            else:
                pending.discard(ref)
                ray.get(ref)  # a failed result raises its error now
        if deadline is not None and time.monotonic() >= deadline and pending:
            break  # ray.get below raises its own GetTimeoutError
    return ray.get(refs, timeout=0 if timeout is not None else None)


class WatchingRay:
    """The ``ray`` module as an upstream method sees it, with ``get`` watching ``actors`` (:func:`watched_get`)."""

    def __init__(self, actors: Mapping[str, object]) -> None:
        self._actors = dict(actors)

    def get(self, refs, *, timeout=None):
        return watched_get(refs, self._actors, timeout=timeout)

    def __getattr__(self, name):
        return getattr(ray, name)
