"""``python -m d3s_openrlhf.cli.train_ppo_ray``: OpenRLHF's ``train_ppo_ray`` with the ``--d3s.*`` flags.

Every flag of ``openrlhf.cli.train_ppo_ray`` is accepted unchanged; the ``--d3s.<field>`` flags come from
``D3SConfig.add_arguments`` and are parsed separately (``parse_known_args``), so upstream's own parser, validation
and ``train()`` run as shipped (through ``runpy``).

* D3S off (no flags, ``--d3s.preset grpo``, or nothing selected at any point): upstream's module runs with the
  remaining arguments and nothing is swapped.
* D3S on: the configuration is validated against the host flags before anything else happens (so before
  ``ray.init`` and before any actor exists); then, for the duration of the run, the resolved config is attached
  to the host args as ``args.d3s`` (a namespace of the ``D3SConfig`` fields, added by wrapping
  ``openrlhf.utils.config.hierarchize``, so every Ray worker sees ``strategy.args.d3s``), and the module globals
  that upstream's ``train()`` instantiates are pointed at the D3S classes: ``PolicyModelActor``,
  ``ReferenceModelActor``, ``PPOTrainer`` and ``PPOTrainerAsync``.
* ``--d3s.dry_run`` validates, prints the resolved configuration and the (N, K) and kept counts along the
  schedule, and exits without starting Ray.
* ``--help`` prints upstream's help followed by the D3S flags.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import runpy
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from d3s_openrlhf.core.advantages import ADVANTAGE_ESTIMATORS
from d3s_openrlhf.core.batching import legal_kept_count
from d3s_openrlhf.core.config import FLAG_PREFIX, D3SConfig
from d3s_openrlhf.cpu import preflight as cpu_preflight
from d3s_openrlhf.cpu import runtime as cpu_runtime

UPSTREAM_MODULE = "openrlhf.cli.train_ppo_ray"
PROG = "d3s_openrlhf.cli.train_ppo_ray"


class D3SValidationError(ValueError):
    """A D3S configuration that cannot run with the given host flags; the message names the flags to change."""


# ── parsers ──


def d3s_parser() -> argparse.ArgumentParser:
    """The parser of the ``--d3s.*`` flags alone (no -h: help is shared with upstream's parser)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, usage=argparse.SUPPRESS)
    D3SConfig.add_arguments(parser)
    return parser


class _ParserBuilt(Exception):
    def __init__(self, parser):
        super().__init__("upstream parser captured")
        self.parser = parser


@functools.lru_cache(maxsize=1)
def upstream_parser() -> argparse.ArgumentParser:
    """OpenRLHF's own ``train_ppo_ray`` parser.

    Upstream builds it inline under ``if __name__ == "__main__":``; we run that block and stop it at its
    ``parse_args`` call (nothing after it, in particular no Ray, runs).
    """
    original = argparse.ArgumentParser.parse_args

    def stop(parser, *args, **kwargs):
        raise _ParserBuilt(parser)

    argparse.ArgumentParser.parse_args = stop
    try:
        runpy.run_module(UPSTREAM_MODULE, run_name="__main__")
    except _ParserBuilt as built:
        return built.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError(f"{UPSTREAM_MODULE} did not build an argument parser")


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


# ── validation ──


@dataclass(frozen=True)
class D3SPlan:
    """What a validated configuration does with the host's batch: the rounding unit and kept counts per N."""

    num_prompts: int
    group_size: int
    dp_size: int
    unit: int
    kept_by_n: Mapping[int, int] = field(default_factory=dict)
    notes: Tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.num_prompts * self.group_size


def _schedule_ns(config: D3SConfig) -> range:
    """Every N the schedule can return, whatever the run's length (it moves monotonically from init to final)."""
    if config.schedule == "constant":
        return range(config.n_init, config.n_init + 1)
    return range(min(config.n_init, config.n_final), max(config.n_init, config.n_final) + 1)


def _schedule_moves(config: D3SConfig) -> bool:
    if config.schedule == "constant":
        return False
    return config.n_init != config.n_final or config.k_init != config.k_final


def _group_flags(group: str) -> str:
    return f"--{group}.num_nodes x --{group}.num_gpus_per_node"


def _host_problems(config: D3SConfig, host_args) -> List[str]:
    """Host settings that would hang or silently mis-train with any D3S selection (samples or tokens)."""
    from d3s_openrlhf.integration.experience_maker import data_parallel_size, kept_forward_groups

    problems = []
    dp = data_parallel_size(host_args)
    train_batch = host_args.train.batch_size
    dynamic = host_args.train.dynamic_batch_enable
    if dynamic and train_batch % dp:
        problems.append(
            f"--train.dynamic_batch_enable with --train.batch_size {train_batch} not a multiple of the actor's "
            f"data-parallel size {dp}: upstream's replay buffer then drops samples and takes more optimizer steps "
            "than the LR horizon counts; make --train.batch_size a multiple of the data-parallel size "
            f"({_group_flags('actor')} / --ds.ring_attn_size / --ds.tensor_parallel_size)"
        )
    if host_args.algo.dynamic_filtering_enable and _schedule_moves(config) and config.schedule_steps <= 0:
        problems.append(
            "--algo.dynamic_filtering_enable consumes a varying number of prompts per step, so the run's number of "
            f"steps is not known in advance, but the --d3s.schedule {config.schedule} moves (N {config.n_init} -> "
            f"{config.n_final}, K {config.k_init} -> {config.k_final}); set --d3s.schedule_steps to the number of "
            "training steps the schedule (and the LR horizon) should span, or use --d3s.schedule constant"
        )
    if not config.samples_enabled:
        return problems

    # Forwards on the kept rollouts are split over every model group that runs them; under ZeRO-3 each forward
    # is a collective, so every rank of a group must get the same number (kept_count_unit folds the groups'
    # sizes in without dynamic batching; with it, upstream plans a multiple of the actor's size).
    groups = kept_forward_groups(host_args)
    rm_used = not (host_args.reward.remote_url or host_args.train.agent_func_path)
    if rm_used:
        groups["reward"] = data_parallel_size(host_args, "reward")
    for group, size in groups.items():
        if size < 1:
            problems.append(
                f"the {group} model group has an effective data-parallel size of 0 ({_group_flags(group)} = "
                f"{getattr(host_args, group).num_nodes * getattr(host_args, group).num_gpus_per_node} < "
                "--ds.ring_attn_size x --ds.tensor_parallel_size); give it more GPUs"
            )
        elif dynamic and dp % size:
            problems.append(
                f"--train.dynamic_batch_enable plans experience-making micro-batches in multiples of the actor's "
                f"data-parallel size {dp}, which the {group} model group's size {size} ({_group_flags(group)}) "
                "does not divide: its ranks would run unequal numbers of forwards (a hang under ZeRO-3); give the "
                f"{group} group a data-parallel size dividing {dp}, or turn dynamic batching off"
            )
    if rm_used and not dynamic and groups["reward"] >= 1:
        total = host_args.rollout.batch_size * host_args.rollout.n_samples_per_prompt
        micro_batches = -(-total // host_args.rollout.micro_batch_size)
        if micro_batches % groups["reward"]:
            problems.append(
                f"the reward model scores all {total} rollouts in {micro_batches} micro-batches of "
                f"--rollout.micro_batch_size {host_args.rollout.micro_batch_size}, which do not split evenly over "
                f"its {groups['reward']} data-parallel ranks ({_group_flags('reward')}): unequal forwards hang "
                "under ZeRO-3; change --rollout.micro_batch_size or the reward model's GPUs"
            )
    return problems


def validate_against_host(config: D3SConfig, host_args) -> D3SPlan:
    """Check a resolved D3S config against the (hierarchized) host args; raise D3SValidationError or plan."""
    from d3s_openrlhf.integration.experience_maker import (
        data_parallel_size,
        kept_count_unit,
        kept_forward_groups,
    )

    estimator = host_args.algo.advantage.estimator
    group_size = host_args.rollout.n_samples_per_prompt
    num_prompts = host_args.rollout.batch_size
    dp = data_parallel_size(host_args)
    problems = _host_problems(config, host_args)
    if not config.samples_enabled:
        if problems:
            raise D3SValidationError("D3S cannot run with these flags:\n  " + "\n  ".join(problems))
        return D3SPlan(num_prompts, group_size, dp, kept_count_unit(host_args))

    if estimator not in ADVANTAGE_ESTIMATORS:
        problems.append(
            f"--d3s.sample_rule {config.sample_rule} selects rollouts by group-relative advantages, but "
            f"--algo.advantage.estimator is {estimator}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}, or "
            "--d3s.sample_rule none (token selection alone works with any estimator)"
        )
    if group_size <= 1:
        problems.append(
            f"--rollout.n_samples_per_prompt {group_size}: sample selection needs groups of at least 2 rollouts "
            "per prompt (PODS n); raise --rollout.n_samples_per_prompt"
        )
    elif group_size < config.max_n:
        problems.append(
            f"--rollout.n_samples_per_prompt {group_size} is below max(N) = {config.max_n} of the schedule: "
            f"raise --rollout.n_samples_per_prompt to at least {config.max_n} or lower --d3s.n_init/--d3s.n_final "
            f"(now {config.n_init}/{config.n_final})"
        )
    if any(size < 1 for size in kept_forward_groups(host_args).values()):  # no unit exists
        raise D3SValidationError("D3S cannot run with these flags:\n  " + "\n  ".join(problems))

    unit = kept_count_unit(host_args)
    total = num_prompts * group_size
    if host_args.train.dynamic_batch_enable:
        unit_text = f"lcm(--train.batch_size {host_args.train.batch_size}, data-parallel size {dp})"
    else:
        sizes = kept_forward_groups(host_args)
        ranks = " and ".join(f"{group} {size}" for group, size in sizes.items())
        unit_text = (
            f"lcm(--train.batch_size {host_args.train.batch_size}, --rollout.micro_batch_size "
            f"{host_args.rollout.micro_batch_size} x lcm of the data-parallel sizes of the groups that run forwards "
            f"on the kept rollouts: {ranks})"
        )
    if total % unit:
        problems.append(
            f"the rollout batch of --rollout.batch_size {num_prompts} x --rollout.n_samples_per_prompt {group_size} "
            f"= {total} rollouts is not a multiple of {unit} = {unit_text}, so kept counts cannot be split evenly "
            "over the data-parallel ranks and micro-batches; change --rollout.batch_size, "
            "--rollout.n_samples_per_prompt, --train.batch_size, --rollout.micro_batch_size or "
            + ", ".join(f"--{group}.num_nodes/--{group}.num_gpus_per_node" for group in kept_forward_groups(host_args))
            + " (data-parallel size = nodes x GPUs / --ds.ring_attn_size / --ds.tensor_parallel_size)"
        )
    if problems:
        raise D3SValidationError("D3S cannot run with these flags:\n  " + "\n  ".join(problems))

    kept_by_n = {n: legal_kept_count(n * num_prompts, total, unit) for n in _schedule_ns(config)}
    notes = []
    if all(kept == total for kept in kept_by_n.values()):
        notes.append(
            f"every N of the schedule rounds up to all {total} rollouts (unit {unit} = {unit_text}): sample "
            "selection never drops a rollout; lower --train.batch_size or --rollout.micro_batch_size, or raise "
            "--rollout.batch_size"
        )
    return D3SPlan(num_prompts, group_size, dp, unit, kept_by_n, tuple(notes))


def resolve(argv: Sequence[str]):
    """Parse and validate a full command line: (config, host_argv, host_args or None, plan or None).

    ``host_args`` and ``plan`` are None when D3S is off (the host flags are then left to upstream).
    Raises D3SValidationError (bad D3S flags or a host conflict).
    """
    given, host_argv = split_d3s_flags(argv)
    try:
        config = D3SConfig.from_flags(given)
    except ValueError as exc:
        raise D3SValidationError(str(exc)) from exc
    if not config.enabled:
        return config, host_argv, None, None
    host_args = parse_host_args(host_argv)
    return config, host_argv, host_args, validate_against_host(config, host_args)


def format_plan(config: D3SConfig, plan: Optional[D3SPlan], points: int = 4) -> str:
    """The dry-run report: resolved config, then (N, K) and kept rollouts at evenly spaced schedule points."""
    lines = ["D3S configuration (resolved):"]
    lines += [f"  --d3s.{name} {value}" for name, value in config.to_dict().items()]
    if plan is None:
        lines.append("D3S is off: the run is OpenRLHF's own train_ppo_ray, unchanged.")
        return "\n".join(lines)
    lines.append(
        f"host batch: B = {plan.num_prompts} prompts x G = {plan.group_size} rollouts = {plan.total}; "
        f"data-parallel size {plan.dp_size}; kept counts are multiples of {plan.unit}"
    )
    if config.schedule_steps > 0:
        schedule = config.schedule_for(config.schedule_steps)
        steps = sorted({round(i * config.schedule_steps / points) for i in range(points + 1)})
        lines.append(f"schedule ({config.schedule}) over --d3s.schedule_steps {config.schedule_steps}:")
        labels = [f"step {step:>6}" for step in steps]
    else:
        schedule = config.schedule_for(points)
        steps = list(range(points + 1))
        lines.append(f"schedule ({config.schedule}) over the run's rollout steps (shown at training progress p):")
        labels = [f"p = {step / points:.2f}" for step in steps]
    for label, step in zip(labels, steps):
        n, k = schedule.at(step)
        if config.samples_enabled:
            kept = plan.kept_by_n[n]
            sample_text = f"N = {n:>3}  kept rollouts {kept:>6} / {plan.total} ({kept / plan.total:.1%})"
        else:
            sample_text = f"all {plan.total} rollouts"
        lines.append(f"  {label}:  {sample_text}  K = {k:.4f}")
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


# ── running upstream ──


@contextlib.contextmanager
def d3s_installed(config: D3SConfig):
    """Inside the block, upstream's ``train_ppo_ray`` builds the D3S actor, trainers and ``args.d3s``."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
    import openrlhf.trainer.ray.launcher as launcher
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import openrlhf.utils.config as host_config

    from d3s_openrlhf.integration.actor import D3SPolicyModelActor, D3SReferenceModelActor
    from d3s_openrlhf.integration.experience_maker import config_namespace
    from d3s_openrlhf.integration.seams import swapped_globals
    from d3s_openrlhf.integration.trainer import D3SPPOTrainer, D3SPPOTrainerAsync

    upstream_hierarchize = host_config.hierarchize

    def hierarchize_with_d3s(args):
        hierarchized = upstream_hierarchize(args)
        hierarchized.d3s = config_namespace(config)
        return hierarchized

    with contextlib.ExitStack() as stack:
        stack.enter_context(swapped_globals(host_config, hierarchize=hierarchize_with_d3s))
        stack.enter_context(swapped_globals(ppo_actor, PolicyModelActor=D3SPolicyModelActor))
        stack.enter_context(swapped_globals(launcher, ReferenceModelActor=D3SReferenceModelActor))
        stack.enter_context(swapped_globals(ppo_trainer, PPOTrainer=D3SPPOTrainer))
        stack.enter_context(swapped_globals(ppo_trainer_async, PPOTrainerAsync=D3SPPOTrainerAsync))
        yield


def run_upstream(host_argv: Sequence[str]) -> None:
    """Run ``python -m openrlhf.cli.train_ppo_ray <host_argv>`` in this process."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else UPSTREAM_MODULE, *host_argv]
    try:
        runpy.run_module(UPSTREAM_MODULE, run_name="__main__")
    finally:
        sys.argv = saved


def print_help(file=None) -> None:
    file = file or sys.stdout
    file.write(upstream_parser().format_help())
    file.write("\n")
    file.write(d3s_parser().format_help())


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    try:
        config, host_argv, host_args, plan = resolve(argv)
    except D3SValidationError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if config.dry_run:
        print(format_plan(config, plan))
        return
    # D3S_OPENRLHF_CPU=1: the CPU pre-flight of the host flags, then a loopback Ray head with the CPU adjustments
    # in every worker (no-op otherwise). Under the CPU launcher both happened already.
    if cpu_runtime.requested() and not cpu_runtime.active():
        try:
            host_argv = cpu_preflight.prepare(host_argv)
        except ValueError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc
    cpu_runtime.activate_if_requested()
    if not config.enabled:
        run_upstream(host_argv)
        return
    for note in plan.notes:
        print(f"[d3s] warning: {note}", file=sys.stderr)
    with d3s_installed(config):
        run_upstream(host_argv)


if __name__ == "__main__":
    main()
