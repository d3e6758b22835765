"""The host seam: everything that knows OpenRLHF 0.11.x's command line and arguments, in one place.

Every other module asks this one about the host (``args`` are upstream's hierarchized arguments, e.g.
``args.rollout.n_samples_per_prompt``): an OpenRLHF release that renames a flag or changes how a group splits its
forwards is adapted here.

* Command line: upstream builds its parser inline under ``if __name__ == "__main__":`` of
  ``openrlhf.cli.train_ppo_ray``; :func:`run_upstream_main` runs that block (with ``sys.argv`` set) and is the one
  way this package enters it: to capture the parser (:func:`upstream_parser`), to get the arguments that
  upstream's ``train()`` would receive without starting Ray (:func:`upstream_train_args`), or to run it, as
  shipped or with the D3S classes swapped in. The ``--d3s.*`` flags are split off first (:func:`split_d3s_flags`).
* Model groups: per-group GPUs (:func:`group_gpus`), effective data-parallel sizes (:func:`data_parallel_size`),
  the groups that run forwards on the kept rollouts (:func:`kept_forward_groups`) and the placement-group demand
  (:func:`gpu_demand`).
* Kept counts: one rule (:func:`kept_rollout_count` over :func:`kept_count_unit`) for training, the LR horizon
  (:func:`scaled_max_steps`) and the dry run (:func:`validate_against_host`); with ``--d3s.optimizer_steps
  fixed_updates``, the optimizer batch of each rollout step (:func:`fixed_updates_count`).
* Travel form: the config rides in the host args as ``args.d3s`` (:func:`config_namespace`,
  :func:`config_from_args`); the token mask rides in ``experience.info[PG_MASK_KEY]``.
* Validation against the host flags (:func:`validate_against_host`), before Ray starts: one small check per
  refusal, all run from :data:`HOST_CHECKS`, the installed DeepSpeed among them, checked against the range this
  package supports (:data:`DEEPSPEED_RANGE`, declared in setup.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
import os
import re
import runpy
import sys
from dataclasses import dataclass, field
from importlib import metadata
from types import SimpleNamespace
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from d3s_openrlhf.core.advantages import ADVANTAGE_ESTIMATORS
from d3s_openrlhf.core.batching import fixed_updates_unit, kept_unit, legal_kept_count, updates_per_rollout_step
from d3s_openrlhf.core.config import FLAG_PREFIX, D3SConfig
from d3s_openrlhf.integration.seams import swapped_globals

UPSTREAM_MODULE = "openrlhf.cli.train_ppo_ray"

PG_MASK_KEY = "d3s_pg_mask"
"""``experience.info`` key of the (S, A) bool mask of the tokens that enter the policy-gradient term (written by
the experience maker in the driver, read by the actor's training step in the workers)."""


class D3SValidationError(ValueError):
    """A D3S configuration that cannot run with the given host flags; the message names the flags to change, and
    ``problems`` holds each refusal of :func:`validate_against_host` on its own."""

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = tuple(problems)


# ── the command line ──


class _Stopped(Exception):
    """Raised from inside upstream's ``__main__`` to stop it at a chosen call, carrying what was captured."""

    def __init__(self, value=None):
        super().__init__("upstream __main__ stopped")
        self.value = value


def run_upstream_main(host_argv: Sequence[str], *swaps: Tuple[object, Mapping[str, object]]) -> None:
    """Run ``python -m openrlhf.cli.train_ppo_ray <host_argv>`` in this process, with ``swaps`` (pairs of
    (module, {global name: replacement})) in place for the duration (see ``seams.swapped_globals``)."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else UPSTREAM_MODULE, *host_argv]
    try:
        with contextlib.ExitStack() as stack:
            for owner, replacements in swaps:
                stack.enter_context(swapped_globals(owner, **replacements))
            runpy.run_module(UPSTREAM_MODULE, run_name="__main__")
    finally:
        sys.argv = saved


@functools.lru_cache(maxsize=1)
def upstream_parser() -> argparse.ArgumentParser:
    """OpenRLHF's own ``train_ppo_ray`` parser: upstream's ``__main__`` stopped at its ``parse_args`` call (nothing
    after it, in particular no Ray, runs)."""

    def stop(parser, *args, **kwargs):
        raise _Stopped(parser)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = stop
    try:
        run_upstream_main([])
    except _Stopped as stopped:
        return stopped.value
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError(f"{UPSTREAM_MODULE} did not build an argument parser")


def upstream_train_args(host_argv: Sequence[str]):
    """The (hierarchized) args upstream's ``__main__`` hands to ``train()`` for ``host_argv``, without Ray: its
    derived values filled in (``--train.dynamic_batch_enable`` forces ``--ds.packing_samples``, ``gae`` adds a
    critic) and its own assertions run.

    Raises ValueError with upstream's message when one of its checks fails; argparse errors exit as usual.
    """
    import openrlhf.utils.config as host_config
    import ray

    captured = {}
    hierarchize = host_config.hierarchize

    def capture(args):
        captured["args"] = hierarchize(args)
        return captured["args"]

    def stop():  # the first thing upstream's train() does
        raise _Stopped

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run_upstream_main(host_argv, (host_config, {"hierarchize": capture}), (ray, {"is_initialized": stop}))
    except _Stopped:
        return captured["args"]
    except (AssertionError, TypeError, ValueError) as exc:
        raise ValueError(f"OpenRLHF's train_ppo_ray rejects these flags: {exc}") from exc
    raise RuntimeError(f"{UPSTREAM_MODULE} returned without calling train()")


def d3s_parser() -> argparse.ArgumentParser:
    """The parser of the ``--d3s.*`` flags alone (no -h: help is shared with upstream's parser)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, usage=argparse.SUPPRESS)
    D3SConfig.add_arguments(parser)
    return parser


def split_d3s_flags(argv: Sequence[str]) -> Tuple[Dict[str, object], List[str]]:
    """(given ``d3s.<field>`` values, remaining host arguments). Raises D3SValidationError on unknown --d3s.*."""
    namespace, host_argv = d3s_parser().parse_known_args(list(argv))
    unknown = [arg for arg in host_argv if arg.startswith("--" + FLAG_PREFIX)]
    if unknown:
        raise D3SValidationError(
            f"unknown D3S flag(s) {', '.join(unknown)}; see the D3S section of --help for the --{FLAG_PREFIX}* flags"
        )
    given = {key: value for key, value in vars(namespace).items() if value is not None}
    return given, host_argv


def parse_host_args(host_argv: Sequence[str]):
    """The host flags as upstream's ``__main__`` sees them right after ``hierarchize`` (before its checks)."""
    from openrlhf.utils.config import hierarchize

    return hierarchize(upstream_parser().parse_args(list(host_argv)))


# ── the config's travel form ──


def config_from_args(args) -> Optional[D3SConfig]:
    """The D3SConfig injected by the entrypoint as ``args.d3s`` (a D3SConfig, a dict or a namespace of its
    fields), or None (D3S off)."""
    d3s = getattr(args, "d3s", None)
    if d3s is None or isinstance(d3s, D3SConfig):
        return d3s
    return D3SConfig(**(dict(d3s) if isinstance(d3s, Mapping) else vars(d3s)))


def config_namespace(config: D3SConfig) -> SimpleNamespace:
    """The form in which the config travels inside the host args (``args.d3s``)."""
    return SimpleNamespace(**config.to_dict())


def full_logits_requested(args) -> bool:
    """Whether ``--d3s.full_logits`` asks for upstream's forwards (False with D3S off)."""
    config = config_from_args(args)
    return config is not None and config.full_logits


def chunked_logits_requested(args) -> bool:
    """Whether ``--d3s.chunked_logits`` asks for the chunked-logits forwards at every step (False with D3S
    off)."""
    config = config_from_args(args)
    return config is not None and config.chunked_logits


# ── model groups ──


def group_flags(group: str) -> str:
    """The flags that size a model group (``actor``, ``ref``, ``critic``, ``reward``)."""
    return f"--{group}.num_nodes x --{group}.num_gpus_per_node"


def group_gpus(args, group: str) -> int:
    """GPUs a model group asks for: nodes x GPUs per node."""
    section = getattr(args, group)
    return section.num_nodes * section.num_gpus_per_node


def data_parallel_size(args, group: str = "actor") -> int:
    """Effective number of data-parallel ranks of a model group (``actor``, ``ref``, ``critic``, ``reward``), as
    OpenRLHF's ``RayActorGroup`` splits forwards over them (ring-attention / tensor-parallel copies share a chunk)."""
    return group_gpus(args, group) // args.ds.ring_attn_size // args.ds.tensor_parallel_size


def reward_model_used(args) -> bool:
    """Whether rewards come from a reward-model forward (no ``--reward.remote_url``, no agent)."""
    return not (args.reward.remote_url or args.train.agent_func_path)


def kept_forward_groups(args) -> Dict[str, int]:
    """{group: effective data-parallel size} of the model groups that run forwards on the kept rollouts: the actor,
    the reference model (KL coefficient > 0) and the critic (if any). The reward model runs on all rollouts."""
    groups = {"actor": data_parallel_size(args)}
    if args.algo.kl.init_coef > 0:
        groups["ref"] = data_parallel_size(args, "ref")
    if args.critic.model_name_or_path:
        groups["critic"] = data_parallel_size(args, "critic")
    return groups


def gpu_demand(args) -> Optional[Dict[str, int]]:
    """{model group: GPUs} that ``train_ppo_ray`` reserves in placement groups for these args when no groups are
    colocated; None with a colocation flag (groups then share GPUs)."""
    if args.train.colocate_all or args.train.colocate_actor_ref or args.train.colocate_critic_reward:
        return None
    demand = {"actor": group_gpus(args, "actor")}
    if args.algo.kl.init_coef > 0:
        demand["ref"] = group_gpus(args, "ref")
    if args.critic.model_name_or_path:
        demand["critic"] = group_gpus(args, "critic")
    if not args.reward.remote_url:
        demand["reward"] = group_gpus(args, "reward")
    if args.vllm.num_engines:
        demand["vllm"] = args.vllm.num_engines * args.vllm.tensor_parallel_size
    return demand


# ── kept counts ──


def kept_count_unit(args, config: D3SConfig) -> int:
    """Every kept-rollout count is a multiple of this (see ``d3s_openrlhf.core.batching``).

    Without dynamic batching the kept rollouts reach every forward group as kept / micro_batch_size micro-batches,
    which ``RayActorGroup`` splits into equal chunks only when their number is a multiple of the group's effective
    size (ZeRO-3 forwards are collectives: unequal chunks hang), so the unit counts the ranks of every such group.
    With dynamic batching upstream plans the micro-batches itself (a multiple of the actor's size). With fixed
    updates, the optimizer batches of the U updates replace ``--train.batch_size`` in the unit.
    """
    dynamic = bool(args.train.dynamic_batch_enable)
    forward_ranks = data_parallel_size(args) if dynamic else math.lcm(*kept_forward_groups(args).values())
    return kept_unit(optimizer_unit(args, config), args.rollout.micro_batch_size, forward_ranks, dynamic)


def optimizer_unit(args, config: D3SConfig) -> int:
    """The multiple of kept rollouts that the optimizer steps of a rollout step need: ``--train.batch_size``, or with
    fixed updates ``core.batching.fixed_updates_unit`` (U equal optimizer batches of whole micro-batches)."""
    if not config.fixed_updates:
        return args.train.batch_size
    return fixed_updates_unit(
        fixed_updates_count(args),
        args.train.micro_batch_size,
        data_parallel_size(args),
        bool(args.train.dynamic_batch_enable),
    )


def fixed_updates_count(args) -> int:
    """U: the optimizer steps per epoch that every rollout step takes with ``--d3s.optimizer_steps fixed_updates``,
    those of a step training all B x G rollouts (:func:`check_fixed_updates` refuses a batch that is not whole
    optimizer batches)."""
    total = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    return updates_per_rollout_step(total, args.train.batch_size)


def fixed_updates_batch(args, config: Optional[D3SConfig], kept: int) -> Optional[int]:
    """The optimizer batch of a rollout step that trains ``kept`` rollouts (over all data-parallel ranks) with
    ``--d3s.optimizer_steps fixed_updates``: kept / U. None with fixed batches, or for a batch that is not a multiple
    of :func:`optimizer_unit` (a last partial batch, kept whole: trained as upstream would)."""
    if config is None or not config.fixed_updates or kept <= 0:
        return None
    if kept % optimizer_unit(args, config):
        return None
    return kept // fixed_updates_count(args)


def kept_rollout_count(n: int, num_prompts: int, group_size: int, unit: int) -> int:
    """Rollouts kept out of ``num_prompts * group_size`` for N = ``n``: N*B rounded up to a multiple of ``unit``.

    A batch whose size is not a multiple of ``unit`` (only the last, partial batch of an epoch can be, the CLI
    rejects any other) is kept whole, as upstream would train it.
    """
    total = num_prompts * group_size
    if unit > total or total % unit:
        return total
    return legal_kept_count(min(n, group_size) * num_prompts, total, unit)


def steps_unknown_in_advance(args, config: D3SConfig) -> Optional[str]:
    """The flag that makes the run's number of steps unknown before it runs (steps consume a varying number of
    prompts), or None: ``--algo.dynamic_filtering_enable`` replaces filtered prompts, unless the run trains a fixed
    number of steps (:func:`fixed_steps`)."""
    if args.algo.dynamic_filtering_enable and fixed_steps(config, args) is None:
        return "--algo.dynamic_filtering_enable"
    return None


def fixed_steps(config: D3SConfig, args) -> Optional[int]:
    """The run's exact number of training steps, ``--d3s.schedule_steps`` with the prompts cycled as often as it
    takes, when prompts are dropped before training: skipping (where the config requires it), or upstream's dynamic
    filtering with ``--d3s.schedule_steps`` set (GRESO's equal-steps baseline). Else None: upstream's passes over
    the data."""
    if config.skip_enabled or (args.algo.dynamic_filtering_enable and config.schedule_steps > 0):
        return config.schedule_steps
    return None


def rollout_steps(num_prompts: int, args) -> int:
    """Rollout (= training) steps of a run over ``num_prompts`` prompts: one per rollout batch, every episode; the
    fixed number where the run has one (:func:`fixed_steps`).

    Exact unless ``steps_unknown_in_advance``: filtered prompts make steps consume more prompts, so the run has
    fewer steps than this (set ``--d3s.schedule_steps`` then).
    """
    config = config_from_args(args)
    fixed = fixed_steps(config, args) if config is not None else None
    if fixed is not None:
        return fixed
    return max(1, math.ceil(num_prompts / args.rollout.batch_size) * args.train.num_episodes)


def expected_passes(args, config: D3SConfig, num_prompts: int) -> float:
    """Passes over ``num_prompts`` prompts that the fixed steps take at the least (no prompt skipped or
    filtered): S x B / prompts."""
    return config.schedule_steps * args.rollout.batch_size / max(num_prompts, 1)


def local_prompt_count(args) -> Optional[int]:
    """The number of training prompts when ``--data.prompt_dataset`` is one local JSON-lines file (capped by
    ``--data.max_samples``), else None (a hub dataset or a mixture: known only once loaded)."""
    path = args.data.prompt_dataset
    if not (isinstance(path, str) and "," not in path and os.path.isfile(path) and path.endswith(".jsonl")):
        return None
    with open(path, "rb") as f:
        count = sum(1 for line in f if line.strip())
    return min(count, args.data.max_samples)


def scaled_max_steps(args, cfg: D3SConfig, max_steps: int, run_steps: int) -> int:
    """The LR-scheduler horizon when only the kept rollouts are trained (what the actors are built with).

    Rollout step s trains kept(s) samples in ``kept(s) / train.batch_size`` optimizer steps per epoch (kept(s) is a
    multiple of train.batch_size), so over the ``run_steps`` = R rollout steps of the run:

        max_steps' = max_epochs * sum_{s=0}^{R-1} kept(s) / train.batch_size

    with kept(s) the experience maker's count at (N, K) = the schedule at step s. Capped at upstream's
    ``max_steps`` (which counts all B*G rollouts of every step, partial last batches by their size); unchanged
    with ``max_steps`` <= 0, and without sample selection unless the run's steps are set otherwise (below).

    With fixed steps (:func:`fixed_steps`: skipping, or dynamic filtering with ``--d3s.schedule_steps``)
    the run trains exactly R = ``--d3s.schedule_steps`` full batches, cycling over the prompts, so the horizon is
    the formula's, uncapped (upstream's count assumes its passes).

    With fixed updates every rollout step takes the U optimizer steps (per epoch) of a full batch, kept(s) = B x G
    in the formula: upstream's ``max_steps``, or max_epochs x R x U at fixed steps.
    """
    if max_steps <= 0:
        return max_steps
    fixed = fixed_steps(cfg, args)
    full_batches = not cfg.samples_enabled or cfg.fixed_updates  # every step the updates of kept(s) = B x G
    if fixed is not None:
        run_steps = fixed
    elif full_batches:
        return max_steps
    batch, group = args.rollout.batch_size, args.rollout.n_samples_per_prompt
    if full_batches:
        kept_total = run_steps * batch * group
    else:
        schedule, unit = cfg.schedule_for(run_steps), kept_count_unit(args, cfg)
        kept_total = sum(kept_rollout_count(schedule.at(step)[0], batch, group, unit) for step in range(run_steps))
    horizon = args.train.max_epochs * kept_total // args.train.batch_size
    return horizon if fixed is not None else min(max_steps, horizon)


# ── the loss ──


def loss_needs_every_token(args) -> Optional[str]:
    """The flag whose loss term reads the log-probs (or the distribution) of every response token, not only of
    the kept ones, or None (the PPO-clip surrogate alone)."""
    if args.actor.policy_loss_type != "ppo":
        return f"--actor.policy_loss_type {args.actor.policy_loss_type} (GSPO's sequence ratio needs every token)"
    if args.algo.kl.use_loss:
        return "--algo.kl.use_loss (the KL loss needs every token's log-prob)"
    if args.actor.entropy_coef is not None:
        return "--actor.entropy_coef (the entropy loss needs every token's distribution)"
    return None


def deepcompile_blocker(args) -> Optional[str]:
    """Why the chunked-logits and kept-token forwards step aside for upstream's under ``--ds.deepcompile``, or None.
    They call the LM head outside the engine's forward, where ZeRO-3's module hooks gather its weight; DeepCompile
    replaces those hooks with its compiled graph, so the head would be called with its weight still partitioned."""
    if getattr(args.ds, "deepcompile", False):
        return "--ds.deepcompile (it replaces the ZeRO-3 hooks that gather the LM head for a call outside the forward)"
    return None


# ── LoRA ──


def lora_trained(args) -> bool:
    """Whether the run trains LoRA adapters (``--ds.lora.rank > 0``)."""
    return args.ds.lora.rank > 0


def engine_gap_logged(args) -> bool:
    """Whether the run logs the engine's log-prob gap to the trainer (``integration.engine_gap``): under LoRA, unless
    an agent (``--train.agent_func_path``) generates, whose environment may hand back sampling parameters without
    log-probs mid-episode and whose executor may fill them its own way, so they need not line up with the tokens."""
    return lora_trained(args) and not args.train.agent_func_path


def lora_sync_needed(host_argv: Sequence[str]) -> bool:
    """Whether the run trains LoRA adapters, whose weights upstream's sync cannot send to vLLM: the entrypoint then
    syncs the merged weights (``integration.lora_sync``) and logs the engine's gap (``integration.engine_gap``), with
    D3S on or off. Raises D3SValidationError where that sync cannot run."""
    args = parse_host_args(host_argv)
    if not lora_trained(args):
        return False
    if args.ds.tensor_parallel_size > 1:
        raise D3SValidationError(
            f"--ds.lora.rank {args.ds.lora.rank} with --ds.tensor_parallel_size {args.ds.tensor_parallel_size}: "
            "the merged LoRA weight sync gathers whole layers under ZeRO, not tensor-parallel shards; "
            "use --ds.tensor_parallel_size 1"
        )
    return True


# ── DeepSpeed ──

DEEPSPEED_RANGE = ((0, 18, 3), (0, 20))
"""The DeepSpeed versions supported, from the first to the first not (setup.py declares the same range). The
chunked-logits training forward starts the engine's backward from hooks on its log-probs with DeepSpeed's own
machinery: ``deepspeed.runtime.utils.register_output_backward_hooks``, the engine's ``_backward_prologue`` and
``_backward_prologue_per_tensor``, and the hook manager a model output carries (``_backward_hook_managers``, its
``_make_backward_hook`` and ``hook_handles``), all from DeepSpeed 0.18.3 on (its PyTorch-compatible backward,
deepspeedai/DeepSpeed#7665; 0.18.2 and earlier start the backward in ``engine.backward``). Private names: the range
ends before the next minor release. Tested with 0.19.6, the version OpenRLHF 0.11.2 pins."""
DEEPSPEED_TESTED = "0.19.6"


def _dotted(version: Tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def deepspeed_requirement() -> str:
    """:data:`DEEPSPEED_RANGE` as a pip requirement: ``deepspeed>=0.18.3,<0.20``."""
    low, high = DEEPSPEED_RANGE
    return f"deepspeed>={_dotted(low)},<{_dotted(high)}"


def deepspeed_problem(installed: Optional[str]) -> Optional[str]:
    """Why the installed DeepSpeed (its version string, None when not installed) cannot run D3S, or None."""
    fix = f"pip install deepspeed=={DEEPSPEED_TESTED} (supported: {deepspeed_requirement()})"
    if installed is None:
        return f"deepspeed is not installed: {fix}"
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", installed)
    low, high = DEEPSPEED_RANGE
    if found is not None and low <= tuple(int(part or 0) for part in found.groups()) < high:
        return None
    return (
        f"deepspeed {installed} is installed; D3S's training forward starts DeepSpeed's backward with the output "
        f"backward hooks of {deepspeed_requirement()}: {fix}"
    )


def installed_deepspeed() -> Optional[str]:
    """The installed DeepSpeed's version, or None."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


# ── validation against the host flags ──


@dataclass(frozen=True)
class D3SPlan:
    """What a validated configuration does with the host's batch: the rounding unit, and per N the kept count and
    the optimizer steps (per epoch) that train it."""

    num_prompts: int
    group_size: int
    dp_size: int
    unit: int
    kept_by_n: Mapping[int, int] = field(default_factory=dict)
    updates_by_n: Mapping[int, int] = field(default_factory=dict)
    notes: Tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.num_prompts * self.group_size


# Each check below is one refusal: (config, host args) -> what to change, naming the flags, or None. They all run
# (HOST_CHECKS), so that every problem is reported at once, before Ray starts.

HostCheck = Callable[[D3SConfig, object], Optional[str]]

MODEL_GROUPS = ("actor", "ref", "critic", "reward")


def check_deepspeed(config: D3SConfig, args) -> Optional[str]:
    """The installed DeepSpeed is in :data:`DEEPSPEED_RANGE`."""
    return deepspeed_problem(installed_deepspeed())


def check_dynamic_batch_split(config: D3SConfig, args) -> Optional[str]:
    """Under dynamic batching the train batch splits evenly over the actor's data-parallel ranks."""
    dp, train_batch = data_parallel_size(args), args.train.batch_size
    if not (args.train.dynamic_batch_enable and dp >= 1 and train_batch % dp):
        return None
    return (
        f"--train.dynamic_batch_enable with --train.batch_size {train_batch} not a multiple of the actor's "
        f"data-parallel size {dp}: upstream's replay buffer then drops samples and takes more optimizer steps "
        "than the LR horizon counts; make --train.batch_size a multiple of the data-parallel size "
        f"({group_flags('actor')} / --ds.ring_attn_size / --ds.tensor_parallel_size)"
    )


def check_schedule_horizon(config: D3SConfig, args) -> Optional[str]:
    """A moving schedule has a horizon in steps when the host makes the run's steps unknown in advance."""
    unknown_steps = steps_unknown_in_advance(args, config)
    if not (unknown_steps and config.schedule_moves and config.schedule_steps <= 0):
        return None
    return (
        f"{unknown_steps} consumes a varying number of prompts per step, so the run's number of "
        f"steps is not known in advance, but the --d3s.schedule {config.schedule} moves (N {config.n_init} -> "
        f"{config.n_final}, K {config.k_init} -> {config.k_final}); set --d3s.schedule_steps S (the run then "
        "trains exactly S steps, cycling over the prompts, and the schedule and the LR horizon span them), or use "
        "--d3s.schedule constant"
    )


def check_generate_batch_size(config: D3SConfig, args) -> Optional[str]:
    """A step trains the B prompts' groups that D3S counts it as, where D3S counts them. Upstream's
    ``generate_samples`` draws ``--rollout.vllm_generate_batch_size`` prompts a call, sync and async alike (unset or
    0: B; above B, async mode's over-sampling, its buffer serves B a step), so below B every step trains fewer.
    Refused where D3S counts steps of B: sample selection's kept counts (and their unit) and LR horizon, the fixed
    steps' LR horizon, the (N, K) schedule's horizon in steps. Elsewhere (chunked logits, token selection over
    ``--d3s.schedule_steps`` or a constant K) the run counts as upstream's, whose LR horizon counts prompts, not
    steps; so does a run with D3S off, which no host check sees."""
    generate, batch = args.rollout.vllm_generate_batch_size, args.rollout.batch_size
    if not generate or generate >= batch:
        return None
    if config.samples_enabled:
        counted = "sample selection's kept counts and the LR horizon count B x G rollouts a step"
    elif fixed_steps(config, args) is not None:
        counted = f"the --d3s.schedule_steps {config.schedule_steps} fixed steps' LR horizon counts B prompts a step"
    elif config.schedule_moves and config.schedule_steps <= 0:
        counted = "the (N, K) schedule's horizon counts the run's steps as B prompts each"
    else:
        return None
    return (
        f"--rollout.vllm_generate_batch_size {generate} is below --rollout.batch_size {batch}: every step trains "
        f"{generate} prompts' groups, but {counted}; raise --rollout.vllm_generate_batch_size to at least "
        f"--rollout.batch_size (or leave it unset), or lower --rollout.batch_size to {generate}"
    )


def check_generation_rewards(config: D3SConfig, args) -> Optional[str]:
    """Prompt skipping gets each prompt's rewards as its rollouts are generated."""
    if not (config.skip_enabled and reward_model_used(args)):
        return None
    return (
        f"--d3s.prompt_skip {config.prompt_skip} decides from the rewards of each prompt's rollouts as they are "
        "generated, but these flags score rollouts with a reward model after generation; give rewards at generation "
        "time (--reward.remote_url or --train.agent_func_path), or turn prompt skipping off"
    )


def check_skip_group_size(config: D3SConfig, args) -> Optional[str]:
    """Prompt skipping sees reward variance: at least 2 rollouts per prompt."""
    group_size = args.rollout.n_samples_per_prompt
    if not (config.skip_enabled and group_size < 2):
        return None
    return (
        f"--d3s.prompt_skip {config.prompt_skip} skips prompts whose groups had no reward variance, which needs "
        f"at least 2 rollouts per prompt; --rollout.n_samples_per_prompt is {group_size}"
    )


def check_stall_passes(config: D3SConfig, args) -> Optional[str]:
    """--d3s.stall_passes bounds a run that cannot fill its batches, which only dynamic filtering at fixed steps can
    be: elsewhere every drawn prompt's group joins (a skip candidate is still generated with probability at least
    --d3s.skip_floor), and the flag would be ignored."""
    can_stall = args.algo.dynamic_filtering_enable and fixed_steps(config, args) is not None
    if config.stall_passes == D3SConfig.stall_passes or can_stall:
        return None
    return (
        f"--d3s.stall_passes {config.stall_passes} does nothing here: only --algo.dynamic_filtering_enable with "
        "--d3s.schedule_steps can leave a batch unfilled; drop it"
    )


def _selection_forward_size(args, group: str) -> Optional[int]:
    """The effective data-parallel size of ``group`` if it runs forwards that sample selection splits (those on
    the kept rollouts, and the reward model's on all of them), else None. Under ZeRO-3 each forward is a
    collective, so every rank of such a group must get the same number."""
    if group == "reward":
        return data_parallel_size(args, "reward") if reward_model_used(args) else None
    return kept_forward_groups(args).get(group)


def check_group_has_ranks(config: D3SConfig, args, group: str) -> Optional[str]:
    """With sample selection, a model group that runs forwards has at least one data-parallel rank."""
    size = _selection_forward_size(args, group) if config.samples_enabled else None
    if size is None or size >= 1:
        return None
    return (
        f"the {group} model group has an effective data-parallel size of 0 ({group_flags(group)} = "
        f"{group_gpus(args, group)} < --ds.ring_attn_size x --ds.tensor_parallel_size); give it more GPUs"
    )


def check_group_divides_actor(config: D3SConfig, args, group: str) -> Optional[str]:
    """With sample selection and dynamic batching, a model group's size divides the actor's, in whose multiples
    upstream plans the experience-making micro-batches."""
    dynamic = config.samples_enabled and args.train.dynamic_batch_enable
    size = _selection_forward_size(args, group) if dynamic else None
    dp = data_parallel_size(args)
    if size is None or size < 1 or dp % size == 0:
        return None
    return (
        f"--train.dynamic_batch_enable plans experience-making micro-batches in multiples of the actor's "
        f"data-parallel size {dp}, which the {group} model group's size {size} ({group_flags(group)}) "
        "does not divide: its ranks would run unequal numbers of forwards (a hang under ZeRO-3); give the "
        f"{group} group a data-parallel size dividing {dp}, or turn dynamic batching off"
    )


def check_reward_micro_batches(config: D3SConfig, args) -> Optional[str]:
    """With sample selection and no dynamic batching, the reward model's micro-batches of all rollouts split evenly
    over its ranks."""
    dynamic = args.train.dynamic_batch_enable
    size = _selection_forward_size(args, "reward") if config.samples_enabled and not dynamic else None
    if size is None or size < 1:
        return None
    total = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    micro_batches = -(-total // args.rollout.micro_batch_size)
    if micro_batches % size == 0:
        return None
    return (
        f"the reward model scores all {total} rollouts in {micro_batches} micro-batches of "
        f"--rollout.micro_batch_size {args.rollout.micro_batch_size}, which do not split evenly over "
        f"its {size} data-parallel ranks ({group_flags('reward')}): unequal forwards hang "
        "under ZeRO-3; change --rollout.micro_batch_size or the reward model's GPUs"
    )


def check_estimator(config: D3SConfig, args) -> Optional[str]:
    """Sample selection ranks rollouts by group-relative advantages: the host's estimator computes those."""
    estimator = args.algo.advantage.estimator
    if not config.samples_enabled or estimator in ADVANTAGE_ESTIMATORS:
        return None
    return (
        f"--d3s.sample_rule {config.sample_rule} selects rollouts by group-relative advantages, but "
        f"--algo.advantage.estimator is {estimator}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}, or "
        "--d3s.sample_rule none (token selection alone works with any estimator)"
    )


def check_selection_group_size(config: D3SConfig, args) -> Optional[str]:
    """Sample selection draws from groups of at least 2 rollouts, and at least max(N) of them."""
    group_size = args.rollout.n_samples_per_prompt
    if not config.samples_enabled or group_size >= max(2, config.max_n):
        return None
    if group_size <= 1:
        return (
            f"--rollout.n_samples_per_prompt {group_size}: sample selection needs groups of at least 2 rollouts "
            "per prompt (PODS n); raise --rollout.n_samples_per_prompt"
        )
    return (
        f"--rollout.n_samples_per_prompt {group_size} is below max(N) = {config.max_n} of the schedule: "
        f"raise --rollout.n_samples_per_prompt to at least {config.max_n} or lower --d3s.n_init/--d3s.n_final "
        f"(now {config.n_init}/{config.n_final})"
    )


def _unit_text(args, config: D3SConfig) -> str:
    """How :func:`kept_count_unit` is made up, for messages."""
    optimizer = f"--train.batch_size {args.train.batch_size}"
    if config.fixed_updates:
        micro = "" if args.train.dynamic_batch_enable else f" x --train.micro_batch_size {args.train.micro_batch_size}"
        optimizer = (
            f"{optimizer_unit(args, config)} = U {fixed_updates_count(args)} updates{micro} x data-parallel size "
            f"{data_parallel_size(args)} (--d3s.optimizer_steps fixed_updates)"
        )
    if args.train.dynamic_batch_enable:
        return f"lcm({optimizer}, data-parallel size {data_parallel_size(args)})"
    ranks = " and ".join(f"{group} {size}" for group, size in kept_forward_groups(args).items())
    return (
        f"lcm({optimizer}, --rollout.micro_batch_size "
        f"{args.rollout.micro_batch_size} x lcm of the data-parallel sizes of the groups that run forwards "
        f"on the kept rollouts: {ranks})"
    )


def check_fixed_updates(config: D3SConfig, args) -> Optional[str]:
    """With fixed updates, the rollout batch is whole optimizer batches (U exists), and the run's gradient
    accumulation is what the actor changes per rollout step: DeepSpeed's, over the actor's data-parallel ranks."""
    if not config.fixed_updates:
        return None
    total, batch = args.rollout.batch_size * args.rollout.n_samples_per_prompt, args.train.batch_size
    if total % batch:
        return (
            f"--d3s.optimizer_steps fixed_updates takes the updates of a full batch at every step, B x G / "
            f"--train.batch_size, but --rollout.batch_size {args.rollout.batch_size} x --rollout.n_samples_per_prompt "
            f"{args.rollout.n_samples_per_prompt} = {total} is not a multiple of --train.batch_size {batch}; make "
            "it one, or use --d3s.optimizer_steps fixed_batch"
        )
    if args.ds.ring_attn_size > 1 or args.ds.tensor_parallel_size > 1:
        return (
            f"--d3s.optimizer_steps fixed_updates with --ds.ring_attn_size {args.ds.ring_attn_size} / "
            f"--ds.tensor_parallel_size {args.ds.tensor_parallel_size}: the per-step gradient accumulation is "
            "tested over data-parallel ranks alone; use sizes 1, or --d3s.optimizer_steps fixed_batch"
        )
    if args.ds.adam_offload and args.ds.zero_stage in (1, 2):
        return (
            f"--d3s.optimizer_steps fixed_updates with --ds.adam_offload at --ds.zero_stage {args.ds.zero_stage}: "
            "that ZeRO optimizer fixes its gradient accumulation when it is built, and fixed updates changes it "
            "every rollout step; use --ds.zero_stage 3, no offload, or --d3s.optimizer_steps fixed_batch"
        )
    return None


def check_kept_unit(config: D3SConfig, args) -> Optional[str]:
    """With sample selection, the rollout batch is a multiple of the kept-count unit (checked where the unit exists:
    every forward group has a rank, else :func:`check_group_has_ranks` refuses)."""
    sizes = kept_forward_groups(args)
    if not config.samples_enabled or any(size < 1 for size in sizes.values()):
        return None
    if check_fixed_updates(config, args) is not None:
        return None  # the unit needs U, which that check refuses
    unit, num_prompts = kept_count_unit(args, config), args.rollout.batch_size
    group_size = args.rollout.n_samples_per_prompt
    total = num_prompts * group_size
    if total % unit == 0:
        return None
    return (
        f"the rollout batch of --rollout.batch_size {num_prompts} x --rollout.n_samples_per_prompt {group_size} "
        f"= {total} rollouts is not a multiple of {unit} = {_unit_text(args, config)}, so kept counts cannot be split "
        "evenly over the data-parallel ranks and micro-batches; change --rollout.batch_size, "
        "--rollout.n_samples_per_prompt, --train.batch_size, --rollout.micro_batch_size or "
        + ", ".join(f"--{group}.num_nodes/--{group}.num_gpus_per_node" for group in sizes)
        + " (data-parallel size = nodes x GPUs / --ds.ring_attn_size / --ds.tensor_parallel_size)"
    )


HOST_CHECKS: Tuple[HostCheck, ...] = (
    check_deepspeed,
    check_dynamic_batch_split,
    check_schedule_horizon,
    check_generate_batch_size,
    check_generation_rewards,
    check_skip_group_size,
    check_stall_passes,
    *(
        functools.partial(check, group=group)
        for group in MODEL_GROUPS
        for check in (check_group_has_ranks, check_group_divides_actor)
    ),
    check_reward_micro_batches,
    check_estimator,
    check_selection_group_size,
    check_fixed_updates,
    check_kept_unit,
)
"""Every refusal of a D3S config with the host flags (any selection, or --d3s.chunked_logits alone), in the order
they are reported."""


def host_problems(config: D3SConfig, host_args) -> List[str]:
    """What every check of :data:`HOST_CHECKS` refuses, in order; empty when the config can run."""
    return [problem for check in HOST_CHECKS if (problem := check(config, host_args)) is not None]


def validate_against_host(config: D3SConfig, host_args) -> D3SPlan:
    """Check a resolved D3S config against the (hierarchized) host args; raise D3SValidationError listing every
    problem, or plan."""
    problems = host_problems(config, host_args)
    if problems:
        raise D3SValidationError("D3S cannot run with these flags:\n  " + "\n  ".join(problems), problems)
    notes = []
    reason = deepcompile_blocker(host_args)
    if reason is not None and (config.tokens_enabled or config.chunked_logits):
        notes.append(f"{reason}: the experience and training forwards build upstream's full logits at every step")
    num_prompts, group_size = host_args.rollout.batch_size, host_args.rollout.n_samples_per_prompt
    dp, unit = data_parallel_size(host_args), kept_count_unit(host_args, config)
    if not config.samples_enabled:
        return D3SPlan(num_prompts, group_size, dp, unit, notes=tuple(notes))
    total = num_prompts * group_size
    kept_by_n = {n: kept_rollout_count(n, num_prompts, group_size, unit) for n in config.n_values}
    updates_by_n = {
        n: kept // (fixed_updates_batch(host_args, config, kept) or host_args.train.batch_size)
        for n, kept in kept_by_n.items()
    }
    if all(kept == total for kept in kept_by_n.values()):
        notes.append(
            f"every N of the schedule rounds up to all {total} rollouts (unit {unit} = "
            f"{_unit_text(host_args, config)}): sample selection never drops a rollout; lower --train.batch_size or "
            "--rollout.micro_batch_size, or raise --rollout.batch_size"
        )
    return D3SPlan(num_prompts, group_size, dp, unit, kept_by_n, updates_by_n, tuple(notes))
