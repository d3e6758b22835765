"""Activation of the CPU runtime in the driver process.

:func:`activate` (idempotent)
 - applies :mod:`d3s_openrlhf.cpu.patches` in this process;
 - connects to the Ray cluster given by ``address`` / ``RAY_ADDRESS``, or starts a local Ray head bound to
   the loopback address only, with the fake GPU resources OpenRLHF's placement groups ask for (OpenRLHF
   waits on ``pg.ready()`` without a timeout, so too few GPUs would hang, not fail);
 - gives every Ray worker of the job the same adjustments through the job's runtime environment
   (``worker_process_setup_hook`` plus environment variables); nothing in site-packages is edited;
 - sets the single-process ``torch.distributed`` variables for modules that train in the driver itself
   (``openrlhf.cli.train_sft``), unless they are already set.
:func:`shutdown` disconnects, which also stops a head that :func:`activate` started.

Other entrypoints opt in with ``D3S_OPENRLHF_CPU=1`` and call :func:`activate_if_requested` first.
"""

import atexit
import os

from d3s_openrlhf.cpu import patches, precision
from d3s_openrlhf.cpu.ports import free_port
from d3s_openrlhf.integration import host

ENV_FLAG = patches.CPU_ENV
SETUP_HOOK = "d3s_openrlhf.cpu.patches.apply"
DEFAULT_FAKE_GPUS = 8
DEFAULT_LOGICAL_CPUS = 32
RAY_START_ATTEMPTS = 3
RAY_START_TIMEOUT = "timed out during startup"  # Ray's message when the raylet missed its 30 s

# Environment every Ray worker of the job gets (values already set in the driver win).
WORKER_ENV_DEFAULTS = {
    # vLLM CPU: KV cache size in GiB; its default (4) does not fit beside the trainers on small machines.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Let the engine use the cores it is given instead of pinning OpenMP threads to fixed cores.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM runs its model executor inside the engine-core process instead of spawning one more worker process
    # (what OpenRLHF itself sets under --train.full_determinism_enable): ~10 s less start-up per run on 2 cores.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # The same three OpenRLHF's train() would pass when it initialises Ray itself.
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    ENV_FLAG: "1",
}

_state = {"active": False, "num_gpus": None}  # num_gpus: of the head activate() started


def requested():
    return os.environ.get(ENV_FLAG, "") == "1"


def active():
    """Whether :func:`activate` ran in this process (the CPU launcher activates before the module it runs)."""
    return _state["active"]


def activate_if_requested(**kwargs):
    """Activate the CPU runtime if ``D3S_OPENRLHF_CPU=1``; return whether it is active. For entrypoints."""
    if not requested():
        return False
    activate(**kwargs)
    return True


def check_gpu_demand(args, num_gpus=DEFAULT_FAKE_GPUS):
    """Raise ``ValueError`` naming the flags when the run would wait forever for GPUs on the local CPU head
    (the one :func:`activate` started, or will start with ``num_gpus``; None, or a cluster given by address:
    not checked). Upstream waits on its placement groups without a timeout, so a demand above the head's fake
    GPUs would hang instead of failing."""
    if _state["active"]:
        num_gpus = _state["num_gpus"]
    elif os.environ.get("RAY_ADDRESS"):
        num_gpus = None
    demand = host.gpu_demand(args)
    if num_gpus is None or demand is None or sum(demand.values()) <= num_gpus:
        return
    parts = ", ".join(f"--{group}.num_nodes x --{group}.num_gpus_per_node = {n}" for group, n in demand.items())
    raise ValueError(
        f"the CPU runtime has {num_gpus} fake GPUs but this run's placement groups ask for "
        f"{sum(demand.values())} ({parts}; vllm = --vllm.num_engines x --vllm.tensor_parallel_size), and OpenRLHF "
        "would wait for them forever: lower those flags (upstream's default --ref.num_gpus_per_node is 8) or "
        "colocate groups (--train.colocate_actor_ref)"
    )


def _worker_env():
    env = {}
    for key, default in WORKER_ENV_DEFAULTS.items():
        env[key] = os.environ.get(key, default)
    for key in ("TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "PYTHONPATH", "HF_HUB_OFFLINE", precision.FP32_ENV):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def activate(address=None, num_gpus=DEFAULT_FAKE_GPUS, num_cpus=None, object_store_gb=1.0):
    """Make this process (and the Ray job it starts or joins) run OpenRLHF on CPU. Idempotent."""
    if _state["active"]:
        return
    os.environ[ENV_FLAG] = "1"
    for key, default in WORKER_ENV_DEFAULTS.items():
        os.environ.setdefault(key, default)
    patches.apply_driver()

    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = {"env_vars": _worker_env(), "worker_process_setup_hook": SETUP_HOOK}
    if address:
        ray.init(address=address, runtime_env=runtime_env)
    else:
        # With Ray's multi-node switch off, the node address is the loopback one and every Ray server
        # listens on 127.0.0.1 only: the environment variable for Ray's own processes, the constant for this
        # one (read when ray was imported).
        from ray._private import ray_constants

        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        init_local_ray(
            num_gpus=num_gpus,
            num_cpus=num_cpus or max(DEFAULT_LOGICAL_CPUS, os.cpu_count() or 1),
            object_store_memory=int(object_store_gb * 2**30),
            include_dashboard=False,
            runtime_env=runtime_env,
        )
    _state["active"] = True
    _state["num_gpus"] = None if address else num_gpus
    atexit.register(shutdown)

    # openrlhf.cli.train_sft trains in this process: a one-rank torch.distributed world. Set after Ray
    # started, so that Ray's own processes do not inherit them.
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def init_local_ray(**init_kwargs):
    """``ray.init(address="local", **init_kwargs)``, tried up to :data:`RAY_START_ATTEMPTS` times. Ray gives a new
    head's raylet a fixed 30 s to register with its GCS (``ray/_private/node.py``, not configurable in 2.55), which
    a loaded machine can miss; the missed attempt's processes are stopped before the next. Other errors raise."""
    import psutil
    import ray

    this = psutil.Process()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = {child.pid for child in this.children(recursive=True)}
        try:
            return ray.init(address="local", **init_kwargs)
        except Exception as error:
            if RAY_START_TIMEOUT not in str(error) or attempt == RAY_START_ATTEMPTS:
                raise
        strays = [child for child in this.children(recursive=True) if child.pid not in before]
        for child in strays:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(strays, timeout=30)


def shutdown():
    """Disconnect from Ray; a head started by :func:`activate` stops with it, its workers included."""
    if not _state["active"]:
        return
    import ray

    ray.shutdown()
    _state["active"] = False
