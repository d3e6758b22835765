"""integration/driver_watch.py on a local Ray: the driver's waits watch the engines and model actors from their
creation on and name the phase; ``ray.get`` swapped in the ray module reaches a namespace of its own (as upstream's
``train()`` under runpy); the group travels to the trainer as upstream's. Real actors, killed by SIGKILL."""

import os
import signal
import time

import openrlhf.trainer.ray.launcher as launcher
import pytest
import ray
from openrlhf.trainer.ray.ppo_critic import CriticModelActor
from ray import cloudpickle

from d3s_openrlhf.integration import liveness
from d3s_openrlhf.integration.actor import D3SPolicyModelActor, D3SReferenceModelActor
from d3s_openrlhf.integration.driver_watch import DriverWatch, role
from d3s_openrlhf.integration.liveness import DeadActorError
from d3s_openrlhf.integration.lora_sync import LoRASyncPolicyModelActor
from d3s_openrlhf.integration.seams import swapped_globals

pytestmark = pytest.mark.usefixtures("watch_ray", "short_pings")


def actor_classes():
    """(Model, Engine), defined here so that Ray ships them by value (tests/ is not importable by workers)."""

    class Model:  # a model actor as RayActorGroup creates it
        def __init__(self, world_size, rank, master_addr, master_port):
            pass

        def init_model_from_pretrained(self, seconds):
            time.sleep(seconds)  # stands for policy rank 0 in the weight-sync group's rendezvous
            return seconds

        def save_model(self):
            return "saved"

        def pid(self):
            return os.getpid()

    class Engine:  # a vLLM engine that dies while it loads
        def __init__(self, pid_file):
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)

    return ray.remote(num_cpus=0)(Model), ray.remote(num_cpus=0)(Engine)


Model, Engine = actor_classes()


def engine_killed_while_it_loads(pid_file):
    engine = Engine.remote(str(pid_file))
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    return engine


def test_model_actor_roles_follow_upstream_classes():
    assert [role(c) for c in (D3SPolicyModelActor, LoRASyncPolicyModelActor, D3SReferenceModelActor)] == [
        "policy",
        "policy",
        "reference",
    ]
    assert role(launcher.RewardModelActor) == "reward" and role(CriticModelActor) == "critic"
    assert role(Model) == "Model"


def test_an_engine_dead_while_it_loads_ends_the_models_loading_naming_it_and_the_phase(tmp_path):
    watch = DriverWatch()
    assert watch.get(ray.put(1)) == 1 and watch.phase == liveness.STARTUP  # nothing watched yet: ray.get
    engines = watch.watching_engines(lambda: [engine_killed_while_it_loads(tmp_path / "pid")])()
    group = watch.actor_group(1, 1, Model, num_gpus_per_actor=0)
    refs = group.async_init_model_from_pretrained(600)  # never ends on its own
    assert watch.phase == liveness.MODELS_LOADING
    start = time.monotonic()
    with pytest.raises(DeadActorError, match=r"vLLM engine 0 died during start-up \(the models' loading") as error:
        watch.get(refs)
    # the engine's start-up, its death and a ping interval (on a loaded machine, tens of seconds), not the 600 s
    assert time.monotonic() - start < 120 and "Engine" in str(error.value)
    assert error.value.actor_name == "vLLM engine 0" and len(engines) == 1
    ray.kill(group._actor_handlers[0])


def test_the_phase_moves_to_training_then_the_final_save_and_a_dead_model_actor_is_named():
    watch = DriverWatch()
    group = watch.actor_group(1, 1, Model, num_gpus_per_actor=0)
    assert watch.get(group.async_init_model_from_pretrained(0)) == [0] and watch.phase == liveness.TRAINING
    assert watch.get(group.async_save_model()) == ["saved"] and watch.phase == liveness.FINAL_SAVE
    # SIGKILL, and gone before the next call (ray.kill returns at once: under load that call ran first, "saved")
    pid = ray.get(group._actor_handlers[0].pid.remote())
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    with pytest.raises(DeadActorError, match="Model model actor 0 died during the final save"):
        watch.get(group.async_save_model())  # its own result fails, named as the watched actor's death


def test_swapped_ray_get_watches_a_namespace_of_its_own(tmp_path):
    watch = DriverWatch()
    watch.watching_engines(lambda: [engine_killed_while_it_loads(tmp_path / "pid")])()
    waiter = Model.remote(1, 0, None, None)
    namespace = {}
    with swapped_globals(ray, get=watch.get):
        # what runpy does with upstream's train_ppo_ray: a fresh namespace that imports ray itself
        exec("import ray\ndef train(ref):\n    return ray.get(ref)", namespace)
        with pytest.raises(DeadActorError, match="vLLM engine 0 died during start-up"):
            namespace["train"](waiter.init_model_from_pretrained.remote(600))
    assert ray.get is liveness._ray_get
    ray.kill(waiter)


def test_the_group_travels_as_upstreams_without_the_watch():
    watch = DriverWatch()
    group = watch.actor_group(1, 1, Model, num_gpus_per_actor=0)
    # pickled as the run ships it, while launcher.RayActorGroup is the watch's factory (the class by reference)
    with swapped_globals(launcher, RayActorGroup=watch.actor_group):
        payload = cloudpickle.dumps(group)
    # the class itself is not shipped: pickled then, it would go by value (another process would get a copy)
    assert b"RayActorGroup" not in payload
    shipped = cloudpickle.loads(payload)
    assert type(shipped) is launcher.RayActorGroup and not hasattr(shipped, "_watch")
    assert [a._actor_id for a in shipped._actor_handlers] == [a._actor_id for a in group._actor_handlers]
    ray.kill(group._actor_handlers[0])
