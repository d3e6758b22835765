"""CUDA -> CPU adjustments, applied in the driver and, through Ray's ``worker_process_setup_hook``, in every
Ray worker process. Nothing on disk is edited: each adjustment replaces one attribute at run time.

OpenRLHF modules are patched when (and only if) the process imports them (a post-import hook), so a worker
that never touches DeepSpeed or vLLM does not pay for importing them -- OpenRLHF itself keeps DeepSpeed out
of its vLLM actors on purpose.

What is adjusted, and why:
- ``torch.cuda.set_device/current_device/synchronize/empty_cache/current_stream``: called unconditionally
  by OpenRLHF's actors and strategy; on CPU they become no-ops and ``current_device()`` returns the CPU
  device, so ``tensor.to(torch.cuda.current_device())`` keeps tensors on the CPU.
- ``init_device_mesh("cuda", ...)`` in ``openrlhf.utils.deepspeed.deepspeed``: built on the CPU instead.
- ``NaiveReplayBuffer.__init__`` formats ``f"cuda:{torch.cuda.current_device()}"``; the wrapper lets it
  format a device index, then points the buffer's target device at the CPU.
- ``stateless_init_process_group`` in ``openrlhf.trainer.ray.ppo_actor`` (trainer side of the vLLM weight
  sync): a gloo group instead of PyNccl, which disables itself silently on CPU (weights would stay stale).
- ``RolloutRayActor`` in ``openrlhf.trainer.ray.vllm_engine`` (driver only, where ``create_vllm_engines``
  runs): a subclass that loads the gloo weight-sync worker extension into vLLM (``create_vllm_engines``
  hard-codes OpenRLHF's NCCL one).
- ``flash_attn.flash_attn_func`` / ``flash_attn_varlen_func`` (and the same names in
  ``flash_attn.flash_attn_interface``): the pure-torch kernels of :mod:`d3s_openrlhf.cpu.flash_attn` instead of
  the CUDA extension, which is absent.
- ``is_flash_attn_2_available`` as transformers' flash-attention module reads it (its module global, used when
  it imports the kernels, and its compatibility table's availability check, used when a model is loaded with
  ``attn_implementation="flash_attention_2"``): true, since the stand-in kernels are there. Without it
  transformers refuses flash-attention 2 on CPU, and OpenRLHF's default ``--ds.attn_implementation`` and its
  sample packing (which forces it) could not run.
- ``Init._allgather_params_coalesced`` in ``deepspeed.runtime.zero.partition_parameters``: DeepSpeed's blocking
  ZeRO-3 gather of several parameters at once (a ``GatheredParameters`` block: transformers loading each layer of
  a checkpoint, the LoRA weight sync; the persistent parameters after each optimizer step) launches one async
  all-gather per parameter and waits for the last one only, which on CUDA implies the others (one NCCL stream,
  in order). Gloo runs them on a pool of threads: the last can finish first, and the others' parameters are used
  while still being written. Loading a checkpoint can then leave uninitialised memory in a layer's weight on every
  rank (rank 0 copies the checkpoint into the gathered weight, the gather then overwrites part of it with the
  partitions the model was built with, rank 0 broadcasts the result), and every forward of the run gives NaN
  (issue 30). The replacement gathers them one blocking all-gather at a time (DeepSpeed's own
  ``stage3_allgather_sequential`` path).
- ``BaseDistributedActor._get_free_port`` in ``openrlhf.trainer.ray.launcher``: upstream picks each model group's
  torch.distributed master port by binding port 0 (an ephemeral port) when the actor starts, and binds it again
  only after the model is loaded, tens of seconds later on a CPU, by when an outgoing connection of the job can
  have taken it (``EADDRINUSE`` at ``init_process_group``, seen in a two-node launch-script smoke run). The
  replacement is :func:`d3s_openrlhf.cpu.ports.free_port`, below the ephemeral range.
- ``get_train_ds_config`` as ``openrlhf.utils.deepspeed.deepspeed`` reads it: an Adam or AdamW optimizer section
  gets DeepSpeed's own ``torch_adam`` option (torch's AdamW, the same update), and ``build_shm_op`` in
  ``deepspeed.comm.torch`` builds nothing (its shared-memory all-reduce serves AutoTP inference only; training's
  collectives are torch.distributed's). DeepSpeed otherwise JIT-compiles its CPU Adam and that op, ~80 s of 2 cores,
  for each new environment path: every clean clone of the suite, a user's first run on a fresh machine.

vLLM's own processes (its engine core is a child of the Ray actor, which the setup hook does not reach) load
:func:`apply_vllm` through vLLM's plugin entry point (``vllm.general_plugins``, declared in ``setup.py``). Under
the CPU runtime it makes vLLM's CPU attention use its portable ``vec`` kernel where it would pick the AMX one
(bf16 on CPUs with AMX): that kernel dies with SIGILL at the first request in 4 of 5 engine starts on the
project's Intel Xeon VMs (``tests/cpu/test_cpu_runtime.py``); the ``vec`` kernel never did. Outside the runtime
(``D3S_OPENRLHF_CPU`` unset) the plugin does nothing.

With ``D3S_OPENRLHF_CPU_FP32=1`` (the launcher's ``--fp32``), every model trains, scores and generates in
float32 whatever ``--ds.param_dtype`` says. CPUs without native bf16 arithmetic (no AVX512-BF16 or AMX) emulate
it, about 13x slower than fp32 for the toy Llama's forward and backward on an AVX2 machine; upstream offers
only bf16 and fp16. Three attributes carry the precision:
- ``convert_to_torch_dtype`` in ``openrlhf.utils.utils`` (read at call time by ``Actor`` and the reward/critic
  model loader): float32;
- ``get_train_ds_config`` / ``get_eval_ds_config`` as ``openrlhf.utils.deepspeed.deepspeed`` reads them: built
  with neither bf16 nor fp16 enabled, i.e. DeepSpeed's fp32 engine;
- the vLLM engine's ``dtype`` (``create_vllm_engines`` hard-codes bfloat16): float32, set by the CPU rollout
  actor (:mod:`d3s_openrlhf.cpu.vllm_engine`). The weight sync sends each parameter in its own dtype.

Only attributes that are looked up at call time are replaced (``torch.cuda.*``, class attributes, and module
globals read by plain classes' methods). Methods of OpenRLHF's ``@ray.remote`` classes reach the workers
pickled by value, with their own copy of the module globals they use, so a module global they read could not
be replaced this way; none of the adjustments needs one.
"""

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys
import threading

from d3s_openrlhf.cpu.ports import free_port
from d3s_openrlhf.cpu.precision import fp32_requested

CPU_ENV = "D3S_OPENRLHF_CPU"  # "1" in the driver and every process of a job the CPU runtime starts
_applied = False
_lock = threading.Lock()
_post_import = {}  # module name -> list of callables(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs the registered callbacks right after a watched module has been executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _post_import:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            for callback in _post_import.pop(fullname, []):
                callback(module)

        spec.loader.exec_module = exec_then_patch  # loaders are per-module instances
        return spec


_finder = _PostImportFinder()


def when_imported(name, callback):
    """Call ``callback(module)`` now if ``name`` is imported, else right after its first import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _post_import.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


# ---------------------------------------------------------------------------------------------- torch.cuda
# One function object per replaced attribute: torch._dynamo keys its trace rules by object and rejects an
# object that appears under two names with different rules.
def _set_device(device):
    return None


def _current_device():
    import torch

    return torch.device("cpu")


def _synchronize(device=None):
    return None


def _empty_cache():
    return None


def _current_stream(device=None):
    return None


def _patch_torch_cuda():
    import torch

    torch.cuda.set_device = _set_device
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    torch.cuda.empty_cache = _empty_cache
    torch.cuda.current_stream = _current_stream


@contextlib.contextmanager
def _current_device_is_index_zero():
    import torch

    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.cuda.current_device = saved


# --------------------------------------------------------------------------------------------- openrlhf
def _patch_deepspeed_strategy(module):
    upstream = module.init_device_mesh

    @functools.wraps(upstream)
    def init_device_mesh(device_type, *args, **kwargs):
        return upstream("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    module.init_device_mesh = init_device_mesh


def _patch_replay_buffer(module):
    import torch

    cls = module.NaiveReplayBuffer
    upstream = cls.__init__

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        with _current_device_is_index_zero():
            upstream(self, *args, **kwargs)
        self.target_device = torch.device("cpu")

    cls.__init__ = __init__


def _patch_ppo_actor(module):
    from d3s_openrlhf.cpu.weight_sync import trainer_side_sync_group

    module.stateless_init_process_group = trainer_side_sync_group


def _patch_launcher(module):
    module.BaseDistributedActor._get_free_port = staticmethod(free_port)


def _patch_vllm_engine(module):
    import ray

    from d3s_openrlhf.cpu.vllm_engine import CPURolloutRayActor

    module.RolloutRayActor = ray.remote(CPURolloutRayActor)


def _patch_flash_attn(module):
    from d3s_openrlhf.cpu import flash_attn as cpu_kernels

    for target in (module, module.flash_attn_interface):
        target.flash_attn_func = cpu_kernels.flash_attn_func
        target.flash_attn_varlen_func = cpu_kernels.flash_attn_varlen_func


def _flash_attn_2_available(*args, **kwargs):
    return True


def _patch_transformers_flash_attention(module):
    module.is_flash_attn_2_available = _flash_attn_2_available
    module.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"] = _flash_attn_2_available


# -------------------------------------------------------------------------------------------- deepspeed
def _allgather_params_blocking(self, param_list, hierarchy=0, quantize=False):
    """Every parameter of ``param_list`` whole when this returns (the module docstring says why)."""
    return self._allgather_params_sequential(param_list, hierarchy=hierarchy)


def _patch_zero3_blocking_gather(module):
    module.Init._allgather_params_coalesced = _allgather_params_blocking


def _float32(param_dtype):
    import torch

    return torch.float32


def _patch_dtype_conversion(module):
    module.convert_to_torch_dtype = _float32


def _patch_deepspeed_configs(module):
    for name in ("get_train_ds_config", "get_eval_ds_config"):
        upstream = getattr(module, name)

        @functools.wraps(upstream)
        def fp32_config(*args, _upstream=upstream, **kwargs):
            kwargs["param_dtype"] = "fp32"  # neither "bf16" nor "fp16": both sections disabled
            return _upstream(*args, **kwargs)

        setattr(module, name, fp32_config)


# ------------------------------------------------------------------------------------------ deepspeed's ops
def _torch_adam(upstream):
    @functools.wraps(upstream)
    def train_config(*args, **kwargs):
        config = upstream(*args, **kwargs)
        optimizer = config.get("optimizer")
        if optimizer and optimizer.get("type", "").lower() in ("adam", "adamw"):
            config["optimizer"] = {**optimizer, "params": {**optimizer.get("params", {}), "torch_adam": True}}
        return config

    return train_config


def _patch_deepspeed_optimizer(module):
    module.get_train_ds_config = _torch_adam(module.get_train_ds_config)


def _no_shm_op():
    return None


def _patch_deepspeed_comm(module):
    module.build_shm_op = _no_shm_op


def _portable_attention_isa(upstream):
    @functools.wraps(upstream)
    def attention_isa(*args, **kwargs):
        isa = upstream(*args, **kwargs)
        return "vec" if isa == "amx" else isa

    return attention_isa


def _patch_cpu_attention(module):
    module._get_attn_isa = _portable_attention_isa(module._get_attn_isa)


def apply_vllm():
    """vLLM's general-plugin hook, run once in each vLLM process: the CPU attention ISA choice (module docstring)."""
    if os.environ.get(CPU_ENV) == "1":
        when_imported("vllm.v1.attention.backends.cpu_attn", _patch_cpu_attention)


def apply():
    """Apply the adjustments every process needs (idempotent). This is the Ray ``worker_process_setup_hook``."""
    global _applied
    with _lock:
        if _applied:
            return
        _applied = True
    _patch_torch_cuda()
    when_imported("openrlhf.utils.deepspeed.deepspeed", _patch_deepspeed_strategy)
    when_imported("openrlhf.trainer.ppo_utils.replay_buffer", _patch_replay_buffer)
    when_imported("openrlhf.trainer.ray.ppo_actor", _patch_ppo_actor)
    when_imported("openrlhf.trainer.ray.launcher", _patch_launcher)
    when_imported("flash_attn", _patch_flash_attn)
    when_imported("transformers.modeling_flash_attention_utils", _patch_transformers_flash_attention)
    when_imported("deepspeed.runtime.zero.partition_parameters", _patch_zero3_blocking_gather)
    when_imported("openrlhf.utils.deepspeed.deepspeed", _patch_deepspeed_optimizer)
    when_imported("deepspeed.comm.torch", _patch_deepspeed_comm)
    if fp32_requested():
        when_imported("openrlhf.utils.utils", _patch_dtype_conversion)
        when_imported("openrlhf.utils.deepspeed.deepspeed", _patch_deepspeed_configs)


def apply_driver():
    """:func:`apply` plus the engine swap, which only the process calling ``create_vllm_engines`` needs."""
    apply()
    when_imported("openrlhf.trainer.ray.vllm_engine", _patch_vllm_engine)
