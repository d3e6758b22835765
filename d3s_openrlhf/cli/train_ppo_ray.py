"""``python -m d3s_openrlhf.cli.train_ppo_ray``: OpenRLHF's ``train_ppo_ray`` with the ``--d3s.*`` flags.

Every flag of ``openrlhf.cli.train_ppo_ray`` is accepted unchanged; the ``--d3s.<field>`` flags come from
``D3SConfig.add_arguments`` and are parsed separately (``parse_known_args``), so upstream's own parser, validation
and ``train()`` run as shipped (through ``runpy``).

* D3S off (no flags, ``--d3s.preset grpo``, or nothing selected at any point): upstream's module runs with the
  remaining arguments and three changes only: the trainers' evaluation also logs the unbiased
  ``eval/<datasource>/pass@k``, under LoRA (``--ds.lora.rank > 0``) the policy actor's weight sync is the merged
  one and the engines report their log-probs for ``lora/engine_gap`` (``integration/engine_gap.py``), and the
  driver's waits watch the engines and model actors (``integration/driver_watch.py``: a death ends
  the run instead of hanging it).
* D3S on: the configuration is validated against the host flags before anything else happens (so before
  ``ray.init`` and before any actor exists); then upstream's module runs with the D3S classes and the config
  (``args.d3s``) swapped in for the duration of the run, and the same watch of the driver's waits.
* ``--d3s.dry_run`` validates, prints the resolved configuration and the (N, K) and kept counts along the
  schedule, and exits without starting Ray.
* ``--help`` prints upstream's help followed by the D3S flags.

The swaps of both cases live in ``integration/swaps.py``; this module only parses, validates and calls.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.cpu import preflight as cpu_preflight
from d3s_openrlhf.cpu import runtime as cpu_runtime
from d3s_openrlhf.integration import host
from d3s_openrlhf.integration.host import D3SPlan, D3SValidationError

PROG = "d3s_openrlhf.cli.train_ppo_ray"


def resolve(argv: Sequence[str]):
    """Parse and validate a full command line: (config, host_argv, host_args or None, plan or None).

    ``host_args`` and ``plan`` are None when D3S is off (the host flags are then left to upstream).
    Raises D3SValidationError (bad D3S flags or a host conflict).
    """
    given, host_argv = host.split_d3s_flags(argv)
    try:
        config = D3SConfig.from_flags(given)
    except ValueError as exc:
        raise D3SValidationError(str(exc)) from exc
    if not config.enabled:
        return config, host_argv, None, None
    host_args = host.parse_host_args(host_argv)
    return config, host_argv, host_args, host.validate_against_host(config, host_args)


def format_plan(config: D3SConfig, plan: Optional[D3SPlan], host_args=None, points: int = 4) -> str:
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
    if config.samples_enabled:
        lines.append(
            f"optimizer steps (--d3s.optimizer_steps {config.optimizer_steps}): per epoch of a rollout step, "
            + (
                "those of the full batch, each on kept / that many rollouts"
                if config.fixed_updates
                else "one per --train.batch_size kept rollouts"
            )
        )
    # the points are steps the run trains (global steps 0 .. S - 1, logged as 1 .. S), its first and last among them
    if config.schedule_steps > 0:
        schedule = config.schedule_for(config.schedule_steps)
        steps = sorted({round(i * schedule.last_step / points) for i in range(points + 1)})
        lines.append(
            f"schedule ({config.schedule}) over --d3s.schedule_steps {config.schedule_steps}, "
            f"steps 1 .. {config.schedule_steps} as logged:"
        )
        labels = [f"step {step + 1:>6}" for step in steps]
    else:
        schedule = config.schedule_for(points + 1)
        steps = list(range(points + 1))
        lines.append(f"schedule ({config.schedule}) over the run's rollout steps (shown at training progress p):")
        labels = [f"p = {schedule.progress(step):.2f}" for step in steps]
    for label, step in zip(labels, steps):
        n, k = schedule.at(step)
        if config.samples_enabled:
            kept, updates = plan.kept_by_n[n], plan.updates_by_n[n]
            sample_text = (
                f"N = {n:>3}  kept rollouts {kept:>6} / {plan.total} ({kept / plan.total:.1%})  "
                f"optimizer steps {updates} x {kept // updates} rollouts"
            )
        else:
            sample_text = f"all {plan.total} rollouts"
        lines.append(f"  {label}:  {sample_text}  K = {k:.4f}")
    if host.fixed_steps(config, host_args) is not None:
        lines.append(fixed_steps_line(config, host_args))
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def fixed_steps_line(config: D3SConfig, host_args) -> str:
    """The dry run's word on the fixed steps: S, and the passes over the data it takes (more as prompts are skipped or
    filtered)."""
    draws = config.schedule_steps * host_args.rollout.batch_size
    text = (
        f"fixed steps: the run trains --d3s.schedule_steps {config.schedule_steps} steps of "
        f"{host_args.rollout.batch_size} prompts ({draws} prompts trained), cycling over the prompts"
    )
    prompts = host.local_prompt_count(host_args)
    if prompts is None:
        return text + "; passes over the data = that / the dataset's size, more as prompts are dropped"
    passes = host.expected_passes(host_args, config, prompts)
    return text + f": {passes:.2f} passes over {prompts} prompts at the least, more as prompts are dropped"


# ── running upstream ──


def run(host_argv: Sequence[str], config: D3SConfig, lora: bool = False) -> None:
    """Run upstream's ``train_ppo_ray`` under the run's swaps (``integration.swaps.swaps_for_run``)."""
    from d3s_openrlhf.integration.swaps import swaps_for_run  # the Ray actor classes: for a run, not for --help

    engine_gap = lora and host.engine_gap_logged(host.parse_host_args(host_argv))
    host.run_upstream_main(host_argv, *swaps_for_run(config, lora, engine_gap))


def print_help(file=None) -> None:
    file = file or sys.stdout
    file.write(host.upstream_parser().format_help())
    file.write("\n")
    file.write(host.d3s_parser().format_help())


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    try:
        config, host_argv, host_args, plan = resolve(argv)
        lora = host.lora_sync_needed(host_argv)
    except D3SValidationError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if config.dry_run:
        print(format_plan(config, plan, host_args))
        if lora:
            print(
                "LoRA (--ds.lora.rank > 0): the policy's weight sync sends the merged LoRA layers to vLLM; the "
                "engines report their log-probs, and each step logs their gap to the trainer (lora/engine_gap)"
            )
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
    for note in plan.notes if plan is not None else ():
        print(f"[d3s] warning: {note}", file=sys.stderr)
    run(host_argv, config, lora)


if __name__ == "__main__":
    main()
