"""``watched_get`` on a local Ray: a dead watched actor ends a wait that would never end, with its name and Ray's
cause; a failed result ends it at once; otherwise it is ``ray.get``. Real actors, killed by SIGKILL (an OOM kill)."""

import os
import signal
import time

import pytest
import ray

from d3s_openrlhf.integration.liveness import DeadActorError, WatchingRay, engine_names, watched_get

pytestmark = pytest.mark.usefixtures("watch_ray", "short_pings")


def actor_classes():
    """(Worker, AsyncWorker), defined here so that Ray ships them by value (tests/ is not importable by workers)."""

    class Worker:
        def pid(self):
            return os.getpid()

        def wait(self, seconds):
            time.sleep(seconds)
            return seconds

        def fail(self):
            raise ValueError("no")

    class AsyncWorker(Worker):  # as a vLLM engine: answers pings while it works
        async def work(self, seconds):
            import asyncio

            await asyncio.sleep(seconds)
            return seconds

    return ray.remote(num_cpus=0)(Worker), ray.remote(num_cpus=0)(AsyncWorker)


Worker, AsyncWorker = actor_classes()


def killed(actor):
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
    return actor


@pytest.mark.parametrize("victim_class", [Worker, AsyncWorker])
def test_a_dead_watched_actor_ends_a_wait_on_another(victim_class):
    waiter, victim = Worker.remote(), victim_class.remote()
    blocked = waiter.wait.remote(600)  # stands for the policy actors blocked sending weights to a dead engine
    killed(victim)
    with pytest.raises(ray.exceptions.GetTimeoutError):  # what upstream's plain wait does: nothing, for ever
        ray.get(blocked, timeout=2)
    start = time.monotonic()
    with pytest.raises(DeadActorError, match="vLLM engine 0 died") as error:
        watched_get([blocked], engine_names([victim]))
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert victim_class.__ray_actor_class__.__name__ in message and "worker process has died" in message
    ray.kill(waiter)


def test_a_failed_result_ends_the_wait_at_once_whatever_its_place():
    slow, failing = Worker.remote(), Worker.remote()
    ray.get([slow.__ray_ready__.remote(), failing.__ray_ready__.remote()])  # the clock times the wait, not start-up
    refs = [slow.wait.remote(600), failing.fail.remote()]
    start = time.monotonic()
    with pytest.raises(ValueError, match="no"):
        watched_get(refs, {"slow": slow})
    assert time.monotonic() - start < 10
    ray.kill(slow)


def test_otherwise_it_is_ray_get():
    worker, engine = Worker.remote(), AsyncWorker.remote()
    assert watched_get(worker.wait.remote(0.5), engine_names([engine])) == 0.5  # pings answered along the way
    assert watched_get([worker.wait.remote(0), engine.work.remote(0.6)], {"w": worker}) == [0, 0.6]
    assert watched_get([], {"w": worker}) == []
    with pytest.raises(ray.exceptions.GetTimeoutError):
        watched_get(worker.wait.remote(5), {"w": worker}, timeout=0.3)
    watching = WatchingRay(engine_names([engine]))
    assert watching.get([engine.work.remote(0)]) == [0] and watching.wait is ray.wait and not engine_names(None)
