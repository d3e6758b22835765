"""The speed study's analysis (``speed_study.json``, benchmarks/bench_speed.py): pure functions of the recorded
held-out curves, and :func:`speed_analysis`, which applies them per task and regime.

A run's curve is its held-out greedy accuracy at the warm start (step 0) and every evaluation, each point with
three clocks: the step, the wall time (the sum of the steps' ``timing/step_total``: Ray, vLLM and checkpoint
saving excluded) and the generated response tokens so far. Between evaluations the curve is linear; after the
run's end it stays at its last value (the model a run has at a later time is its last one).

- **Time to a threshold** (:func:`time_to`): where the curve first reaches it, interpolated linearly between the
  two evaluations around the crossing. A run that never reaches it is **censored** at its end: its value is the
  run's end on that clock and a lower bound on the truth.
- **Censored values in means and ratios** (``stats.Interval``): a mean over seeds with a censored seed is a lower
  bound (``>=``); the ratio of an arm's mean to a baseline's is a lower bound where only the arm has censored
  seeds, an upper bound (``<=``) where only the baseline has, and unknown where both have; the interval's ends
  carry the same bound. Intervals are Student-t over seeds: of a mean, and of a ratio on the log scale
  (``stats.log_ratio``: the ratio of geometric seed means).
- **Area under the curve up to a budget** (:func:`area`): the mean held-out greedy accuracy over wall time
  ``[0, budget]``.
- **The learning rate** (:func:`choose_lr`): per task, regime and arm, the rate of the sweep with the highest
  seed-mean area up to the sweep's budget: GRPO's seed-mean total wall time at today's rate (``REFERENCE_LR``),
  one budget shared by every arm and rate of that task and regime.
- **A collapsed run** (:func:`collapsed`): its final held-out greedy accuracy is more than ``COLLAPSE`` below the
  warm start's.
- **One rate for every arm** (phase ``fixed-rate``, bench_speed.py ``--phases fixed-rate --fixed-lr``): no sweep;
  every arm at that rate, as a user who switches an arm on at GRPO's tuned rate runs it; its seeds took no part in
  choosing a rate.
- **Reruns**: an arm timed again at its chosen rate in a later batch (phase ``rerun``) is reported as an arm of its
  own (``RERUN``) and takes no part in the choice: the arms of that batch are compared with it, free of the
  machine's drift between batches.
- **What limits a reading**, counted for the report: thresholds first reached at the first evaluation (their time
  interpolates from the warm start, :func:`before_first_evaluation`), and chosen rates at the sweep's edge
  (:func:`at_sweep_edge`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .stats import log_ratio, mean_std, overlap, t_mean

COLLAPSE = 0.1  # a run whose final greedy accuracy ends more than this below the warm start's has collapsed
REFERENCE_LR = 2e-4  # today's rate: GRPO's total wall time at it is the sweep's budget
CLOCKS = ("step", "wall", "generated")
BASELINES = ("GRPO", "GRPO+DF")
# an arm that adds a level to another arm (bench_speed.ARMS) -> that arm: its ratios are taken to it too, and to its
# rerun, timed in the same later batch
EXTENDS = {"D3S+history": "D3S"}
# an arm timed again at its chosen rate in a later batch (bench_speed.py --phases rerun) is reported as this arm,
# beside the arms of that batch: the machine's speed drifted 10-25% between batches (2026-11-27)
RERUN = " rerun"  # the suffix of such an arm's name
FIXED_RATE = "fixed-rate"  # the phase of runs at one rate given for every arm, without a sweep
UNCHOSEN = (FIXED_RATE, "study")  # phases of runs at a rate their own seeds took no part in choosing


def _clock(curve, clock):
    return np.array([point[clock] for point in curve], dtype=float)


def value_at(curve, clock, at):
    """The curve's held-out greedy accuracy at ``at`` on ``clock``: linear between evaluations, the last value
    after the run's end."""
    return float(np.interp(at, _clock(curve, clock), _clock(curve, "greedy")))


def area(curve, budget, clock="wall"):
    """The mean held-out greedy accuracy over ``[0, budget]`` on ``clock`` (the area under the curve, divided by
    the budget)."""
    xs, ys = _clock(curve, clock), _clock(curve, "greedy")
    inside = xs < budget
    grid = np.append(xs[inside], budget)
    values = np.interp(grid, xs, ys)
    return float(np.sum((grid[1:] - grid[:-1]) * (values[1:] + values[:-1]) / 2) / budget)


def time_to(curve, threshold, clock):
    """``(value, censored)``: where on ``clock`` the curve first reaches ``threshold``, interpolated linearly
    between the evaluations around the crossing; ``(the run's end, True)`` if it never does."""
    xs, ys = _clock(curve, clock), _clock(curve, "greedy")
    hits = np.nonzero(ys >= threshold)[0]
    if not len(hits):
        return float(xs[-1]), True
    i = int(hits[0])
    if i == 0:
        return float(xs[0]), False
    share = (threshold - ys[i - 1]) / (ys[i] - ys[i - 1])
    return float(xs[i - 1] + share * (xs[i] - xs[i - 1])), False


def collapsed(curve, warm_start):
    """Whether the run's final held-out greedy accuracy is more than ``COLLAPSE`` below the warm start's."""
    return curve[-1]["greedy"] < warm_start - COLLAPSE - 1e-12


def thresholds(warm_start, fractions):
    """The accuracies ``warm start + fraction x (1 - warm start)``: set once per task, before its runs."""
    return [warm_start + fraction * (1.0 - warm_start) for fraction in fractions]


def before_first_evaluation(curve, threshold):
    """Whether the curve reaches ``threshold`` at its first evaluation after the warm start, not before: its time
    is then an interpolation from the warm start and reads the first evaluation's accuracy more than a time."""
    return len(curve) > 1 and curve[0]["greedy"] < threshold <= curve[1]["greedy"]


def at_sweep_edge(chosen, rates):
    """Whether the ``chosen`` rate is the lowest or the highest of the swept ``rates`` (of more than one): the best
    rate may then lie outside the sweep."""
    return len(rates) > 1 and chosen in (min(rates), max(rates))


def choose_lr(areas):
    """The rate of ``{lr: [area per seed]}`` with the highest mean area; among equal means, the lowest rate."""
    return max(sorted(areas), key=lambda lr: (np.mean(areas[lr]), -lr))


# -- per task and regime ------------------------------------------------------------------------------------------
def run_key(run):
    """A run's (task, regime)."""
    return run["task"], run["regime"]


def step_costs(runs):
    """Seed means of a run's mean step time and the shares of it spent generating, making experience and training
    (the rest: the weight broadcast); two readings of the machine's speed: seconds of training per step
    (``training_s``: equal work per step for arms that train the same schedule, as D3S and D3S + history) and
    seconds of generation per million generated tokens (``generation_s_per_mtoken``); and the prompts skipped per
    step (the history prior). From the runs' ``totals``, as bench_speed.py records them."""
    totals = {key: [] for key in ("step", "generation", "experience", "training", "training_s", "skipped")}
    totals["generation_s_per_mtoken"] = []
    for run in runs:
        sums = run["totals"]
        total = sums["timing/step_total"]
        totals["step"].append(total / sums["steps"])
        totals["training_s"].append(sums["timing/ppo_train"] / sums["steps"])
        totals["generation_s_per_mtoken"].append(sums["timing/generation"] / sums["generated"] * 1e6)
        totals["skipped"].append(sums["d3s/skipped_prompts"] / sums["steps"])
        for name, key in (
            ("generation", "timing/generation"),
            ("experience", "timing/make_experience"),
            ("training", "timing/ppo_train"),
        ):
            totals[name].append(sums[key] / total)
    return {name: float(np.mean(values)) for name, values in totals.items()}


def sweep_analysis(runs, budget, warm_start):
    """Per arm and rate of the sweep's runs: seeds, areas up to ``budget``, final accuracies, collapsed seeds."""
    sweep = {}
    for run in runs:
        entry = sweep.setdefault(run["arm"], {}).setdefault(run["lr"], dict(seeds=[], area=[], final=[], collapsed=[]))
        entry["seeds"].append(run["seed"])
        entry["area"].append(area(run["curve"], budget) if budget else float("nan"))
        entry["final"].append(run["curve"][-1]["greedy"])
        if collapsed(run["curve"], warm_start):
            entry["collapsed"].append(run["seed"])
    return sweep


def arm_analysis(runs, levels, grpo_wall, warm_start):
    """One arm's study runs (its chosen rate): final accuracy, collapses, times to each threshold per clock,
    accuracy at and area up to GRPO's total wall time (None without GRPO), step costs."""
    times = [{clock: [time_to(run["curve"], level, clock) for run in runs] for clock in CLOCKS} for level in levels]
    return dict(
        seeds=sorted(run["seed"] for run in runs),
        final=[run["curve"][-1]["greedy"] for run in runs],
        collapsed=[run["seed"] for run in runs if collapsed(run["curve"], warm_start)],
        total_wall=float(np.mean([run["curve"][-1]["wall"] for run in runs])),
        times=times,
        mean_times=[{clock: t_mean(level[clock]) for clock in CLOCKS} for level in times],
        first_evaluation=[sum(before_first_evaluation(run["curve"], level) for run in runs) for level in levels],
        at_grpo_wall=None if grpo_wall is None else [value_at(run["curve"], "wall", grpo_wall) for run in runs],
        area=None if grpo_wall is None else [area(run["curve"], grpo_wall) for run in runs],
        costs=step_costs(runs),
    )


def _bases(arm, arms):
    """The arms of ``arms`` that ``arm``'s times are divided by: the baselines; for an arm that extends another
    (``EXTENDS``) that arm, and its rerun; for a rerun the arm it times again."""
    own = EXTENDS.get(arm)
    if arm.endswith(RERUN):
        bases = (*BASELINES, arm.removesuffix(RERUN))
    else:
        bases = BASELINES if own is None else (*BASELINES, own, own + RERUN)
    return list(dict.fromkeys(base for base in bases if base in arms))


def arm_runs(runs, arm, lr):
    """The runs at rate ``lr`` that an arm of the analysis stands for: the arm's sweep and study runs, or for
    ``arm + RERUN`` its reruns."""
    rerun = arm.endswith(RERUN)
    name = arm.removesuffix(RERUN)
    return [
        run
        for run in runs
        if run["arm"] == name and (run["phase"] == "rerun") == rerun and math.isclose(run["lr"], lr, rel_tol=1e-9)
    ]


def regime_analysis(document, task, regime):
    """The study of one task and regime: the sweep with its budget and choices, every collapsed run and every run
    stopped at bench_speed.py's cap (``stopped``: its last evaluation stands as its final one), each arm at
    its chosen rate, and the ratios of its times to each baseline's (GRPO, GRPO + DF, each at its own chosen rate;
    for an arm of the generation level, also the arm it adds its level to and its rerun) with their intervals and
    whether the seed-mean intervals overlap. An arm's reruns at its chosen rate (phase ``rerun``) are the arm
    ``arm + RERUN``, apart from its sweep and study."""
    every = [run for run in document["runs"] if run_key(run) == (task, regime)]
    own = [run for run in every if run["phase"] != "rerun"]
    spec = document["tasks"][task]
    warm_start, levels = spec["warm_start"]["greedy"], spec["thresholds"]
    sweep_runs = [run for run in own if run["phase"] == "sweep"]
    reference = [
        run for run in sweep_runs if run["arm"] == "GRPO" and math.isclose(run["lr"], REFERENCE_LR, rel_tol=1e-9)
    ]
    budget = float(np.mean([run["curve"][-1]["wall"] for run in reference])) if reference else None
    sweep = sweep_analysis(sweep_runs, budget, warm_start)
    # an arm chooses once it has run every rate on every seed of the sweep (as the others have): a partial sweep
    # would choose among fewer rates, and on fewer seeds
    grid = {(run["lr"], run["seed"]) for run in sweep_runs}
    missing = {
        arm: sorted(grid - {(lr, seed) for lr, e in rates.items() for seed in e["seeds"]})
        for arm, rates in sweep.items()
    }
    chosen = {}
    if budget:
        chosen = {
            arm: choose_lr({lr: e["area"] for lr, e in rates.items()})
            for arm, rates in sweep.items()
            if not missing[arm]
        }
    fixed = {run["arm"]: run["lr"] for run in every if run["phase"] == FIXED_RATE and run["arm"] not in chosen}
    arm_lr = {**chosen, **fixed, **{arm + RERUN: lr for arm, lr in chosen.items()}}
    study = {arm: mine for arm, lr in arm_lr.items() if (mine := arm_runs(every, arm, lr))}
    grpo_wall = float(np.mean([run["curve"][-1]["wall"] for run in study["GRPO"]])) if "GRPO" in study else None
    arms = {arm: arm_analysis(runs, levels, grpo_wall, warm_start) for arm, runs in study.items()}
    for arm, m in arms.items():
        m["lr"] = arm_lr[arm]
        m["at_sweep_edge"] = arm in chosen and at_sweep_edge(chosen[arm], list(sweep[arm]))
        m["ratios"], m["overlap"] = {}, {}
        for base in _bases(arm, arms):
            m["ratios"][base] = [
                {clock: log_ratio(mine[clock], theirs[clock]) for clock in CLOCKS}
                for mine, theirs in zip(m["times"], arms[base]["times"])
            ]
            m["overlap"][base] = [
                {clock: overlap(mine[clock], theirs[clock]) for clock in CLOCKS}
                for mine, theirs in zip(m["mean_times"], arms[base]["mean_times"])
            ]
    # the rates were chosen on the sweep's seeds, which then count in the study: the study's own seeds alone
    # are free of that selection (wall clock)
    fresh = {arm: [run for run in runs if run["phase"] in UNCHOSEN] for arm, runs in study.items()}
    for arm, m in arms.items():
        m["study_seeds"] = sorted(run["seed"] for run in fresh[arm])
        m["study_ratios"] = {}
        for base in (b for b in _bases(arm, arms) if fresh[b] and fresh[arm]):
            m["study_ratios"][base] = [
                log_ratio(*([time_to(run["curve"], level, "wall") for run in fresh[a]] for a in (arm, base)))
                for level in levels
            ]
    collapses = [
        dict(arm=run["arm"], lr=run["lr"], seed=run["seed"], phase=run["phase"], final=run["curve"][-1]["greedy"])
        for run in every
        if collapsed(run["curve"], warm_start)
    ]
    stopped = [
        dict(
            arm=run["arm"],
            lr=run["lr"],
            seed=run["seed"],
            phase=run["phase"],
            steps=run["totals"]["steps"],
        )
        for run in every
        if run["stopped"]
    ]
    return dict(
        task=task,
        regime=regime,
        warm_start=warm_start,
        thresholds=levels,
        budget=budget,
        reference_seeds=sorted(run["seed"] for run in reference),
        sweep=sweep,
        chosen=chosen,
        fixed=fixed,
        incomplete={arm: gaps for arm, gaps in missing.items() if gaps},
        grpo_wall=grpo_wall,
        arms=arms,
        collapses=collapses,
        stopped=stopped,
    )


def speed_analysis(document):
    """:func:`regime_analysis` of every task and regime with runs, in the order they were first recorded."""
    keys = list(dict.fromkeys(run_key(run) for run in document["runs"]))
    return [regime_analysis(document, task, regime) for task, regime in keys]


# -- the document ---------------------------------------------------------------------------------------------------
REGIME_TITLES = {"passes": "several passes over {pool} prompts", "fresh": "one pass over fresh prompts"}
CLOCK_LABELS = {"step": "RL step", "wall": "wall time of the steps (s)", "generated": "generated response tokens"}
CLOCK_COLUMNS = {"step": "steps", "wall": "wall s", "generated": "generated tokens"}
LR_COLORS = ("tab:green", "tab:blue", "tab:red", "tab:purple", "tab:orange", "tab:brown")
GRID = 60  # points of the seed-mean curves on the wall-time and token clocks
ARM_COLORS = {
    "GRPO": "tab:gray",
    "GRPO+DF": "tab:red",
    "GRPO+half-batch": "black",
    "PODS": "tab:orange",
    "PODS+fixed-updates": "tab:brown",
    "D3S": "tab:blue",
    "D3S+fixed-updates": "tab:purple",
    "D3S-I": "tab:green",
    "D3S-I+fixed-updates": "tab:olive",
    "D3S+history": "tab:cyan",
}
_D3S = "N 4 -> 12, K 0.2 -> 0.5"
ARM_TEXT = {  # the arms of speed_study.json, in words
    "GRPO+DF": "GRPO + DF (upstream's `--algo.dynamic_filtering_enable`)",
    "PODS": "PODS (n = 16, m = 4, max-variance)",
    "D3S": f"D3S ({_D3S})",
    "D3S-I": f"D3S-I ({_D3S}, intra-group)",
    "D3S+history": "D3S + the history prior (`--d3s.prompt_skip history`; in the passes regime, where prompts recur)",
    "GRPO+half-batch": "GRPO with half its optimizer batch (`--train.batch_size 16`: twice its optimizer steps)",
    "PODS+fixed-updates": "PODS with fixed updates (`--d3s.optimizer_steps fixed_updates`: GRPO's optimizer steps)",
    "D3S+fixed-updates": f"D3S with fixed updates ({_D3S}, `--d3s.optimizer_steps fixed_updates`)",
    "D3S-I+fixed-updates": f"D3S-I with fixed updates ({_D3S}, intra-group, `--d3s.optimizer_steps fixed_updates`)",
}
COMMAND = "`.venv/bin/python benchmarks/bench_speed.py --out benchmarks/results`"
ARMS_AT_GRPOS_RATE = (
    "GRPO GRPO+half-batch D3S D3S+fixed-updates D3S-I+fixed-updates PODS+fixed-updates"  # the equal-updates study's
)
ARMS_SWEPT = "GRPO D3S+fixed-updates D3S-I+fixed-updates"  # the equal-updates study's arms at their own rates


def _equal_updates(task, regime):
    return (
        f"`.venv/bin/python benchmarks/bench_speed.py --name equal_updates --tasks d3s_openrlhf.tasks.{task} "
        f"--regimes {regime} --eval-early 2 20 --micro-batch 8 "
    )


EQUAL_UPDATES_COMMAND = (
    f"{_equal_updates('chainsum_tens', 'fresh')}--phases {FIXED_RATE} --fixed-lr 2.5e-5 --arms {ARMS_AT_GRPOS_RATE} "
    f"--seeds 4 5 6 7`, then {_equal_updates('chainsum_tens', 'fresh')}--phases sweep study --lrs 2.5e-5 5e-5 2e-4 "
    f"--sweep-seeds 0 --seeds 4 5 6 7 --arms {ARMS_SWEPT}`, then {_equal_updates('chainsum', 'passes')}--phases "
    f"{FIXED_RATE} --fixed-lr 5e-5 --arms {ARMS_AT_GRPOS_RATE} --seeds 4 5 6`"
)
# results file stem -> (its section's title, its label in RESULTS.md's head, its command and what it costs)
SECTIONS = {
    "speed_study": (
        "Speed to fixed accuracies, each arm at its tuned learning rate",
        "Speed",
        f"{COMMAND} (about 9 hours on 2 CPU cores; it appends run by run and resumes)",
    ),
    "equal_updates": (
        "Equal updates: the optimizer steps apart, at GRPO's tuned rate and at each arm's own",
        "Equal updates",
        f"{EQUAL_UPDATES_COMMAND} (about 4 hours on 2 CPU cores, 2026-11-28/29)",
    ),
}


def _task_name(task):
    return task.rsplit(".", 1)[-1]


def _runs(document, task, regime):
    return [run for run in document["runs"] if (run["task"], run["regime"]) == (task, regime)]


def seed_band(runs, clock):
    """The grid (0 to the shortest run's end on ``clock``), the seed-mean curve and the seed range on it."""
    end = min(run["curve"][-1][clock] for run in runs)
    grid = np.linspace(0.0, end, GRID)
    values = np.array([[value_at(run["curve"], clock, x) for x in grid] for run in runs])
    return grid, values.mean(axis=0), values.min(axis=0), values.max(axis=0)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_study(document, analyses, regime, path):
    """One row per task of ``regime``: each arm at its chosen rate against steps, wall time and generated tokens
    (seed mean, shaded: the seed range), the thresholds dotted."""
    plt = _pyplot()
    rows = [a for a in analyses if a["regime"] == regime and a["arms"]]
    figure, axes = plt.subplots(len(rows), 3, figsize=(16, 4.2 * len(rows)), squeeze=False)
    for row, analysed in zip(axes, rows):
        runs = _runs(document, analysed["task"], regime)
        for arm, m in analysed["arms"].items():
            mine = arm_runs(runs, arm, m["lr"])
            color = ARM_COLORS.get(arm.removesuffix(RERUN))
            style = "--" if arm.endswith(RERUN) else "-"  # a rerun: its arm's colour, dashed
            for axis, clock in zip(row, CLOCKS):
                grid, mean, low, high = seed_band(mine, clock)
                label = f"{arm} (lr {m['lr']:g}, {len(mine)} seeds)"
                axis.plot(grid, mean, color=color, linestyle=style, label=label)
                axis.fill_between(grid, low, high, color=color, alpha=0.12)
        for axis, clock in zip(row, CLOCKS):
            for level in analysed["thresholds"]:
                axis.axhline(level, color="black", linestyle=":", linewidth=1)
            axis.set_xlabel(CLOCK_LABELS[clock])
            axis.set_ylabel(f"{_task_name(analysed['task'])}: held-out greedy accuracy")
            axis.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    figure.suptitle(f"Speed study, {REGIME_TITLES[regime].format(pool=document['protocol']['pool'])}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_runs(document, analyses, regime, path):
    """Every run's curve against wall time: one row per task of ``regime``, one panel per arm, one colour per
    rate (thick: the chosen one), the sweep's budget dashed."""
    plt = _pyplot()
    rows = [a for a in analyses if a["regime"] == regime]
    arms = list(dict.fromkeys(run["arm"] for a in rows for run in _runs(document, a["task"], regime)))
    lrs = sorted({run["lr"] for run in document["runs"]})
    figure, axes = plt.subplots(len(rows), len(arms), figsize=(3.6 * len(arms), 3.4 * len(rows)), squeeze=False)
    for row, analysed in zip(axes, rows):
        runs = _runs(document, analysed["task"], regime)
        for axis, arm in zip(row, arms):
            for run in (run for run in runs if run["arm"] == arm):
                chosen = analysed["chosen"].get(arm) == run["lr"]
                axis.plot(
                    [p["wall"] for p in run["curve"]],
                    [p["greedy"] for p in run["curve"]],
                    color=LR_COLORS[lrs.index(run["lr"]) % len(LR_COLORS)],
                    linewidth=2.0 if chosen else 0.8,
                    linestyle="--" if run["phase"] == "rerun" else "-",
                )
            if analysed["budget"]:
                axis.axvline(analysed["budget"], color="black", linestyle="--", linewidth=1)
            axis.axhline(analysed["warm_start"] - COLLAPSE, color="gray", linestyle=":", linewidth=1)
            axis.set_title(f"{_task_name(analysed['task'])}: {arm}", fontsize=9)
            axis.set_xlabel("wall time of the steps (s)", fontsize=8)
            axis.set_ylim(-0.02, 1.02)
            axis.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=LR_COLORS[i % len(LR_COLORS)], label=f"lr {lr:g}") for i, lr in enumerate(lrs)]
    figure.legend(handles=handles, loc="upper right", fontsize=8)
    figure.suptitle(
        f"Every run, {REGIME_TITLES[regime].format(pool=document['protocol']['pool'])}: held-out greedy accuracy "
        "(thick: the chosen rate; dashed: reruns, and the vertical line the sweep's budget; dotted: the collapse line)",
        fontsize=10,
    )
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _sweep_lines(analysed):
    lrs = sorted({lr for rates in analysed["sweep"].values() for lr in rates})
    budget = analysed["budget"]
    if not analysed["sweep"] and analysed["fixed"]:
        rates = ", ".join(f"{lr:g}" for lr in dict.fromkeys(analysed["fixed"].values()))
        return [f"**Learning rate.** No sweep: every arm at lr {rates} (`--phases {FIXED_RATE} --fixed-lr`)."]
    if budget is None:
        head = (
            f"**Learning rates.** No choice yet: the sweep's budget is GRPO's total wall time at lr {REFERENCE_LR:g}, "
            "which has no run here."
        )
    else:
        seeds = ", ".join(map(str, analysed["reference_seeds"]))
        head = (
            f"**Learning rates.** Budget: GRPO's seed-mean total wall time at lr {REFERENCE_LR:g} (seeds {seeds}), "
            f"{budget:.0f} s. Per arm and rate: the mean held-out greedy accuracy over wall time [0, budget] (the "
            "area under the curve over the budget; seed mean, seeds in brackets), then the final accuracy; the "
            "chosen rate has the highest mean area."
        )
    lines = [
        head,
        "",
        "| arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |",
        "|---" * (len(lrs) + 2) + "|",
    ]
    for arm, rates in analysed["sweep"].items():
        cells = []
        for lr in lrs:
            if lr not in rates:
                cells.append("-")
                continue
            e = rates[lr]
            collapsed = f", {len(e['collapsed'])} collapsed" if e["collapsed"] else ""
            area = "-" if budget is None else f"{np.mean(e['area']):.3f}"
            cell = f"{area} ({len(e['seeds'])}); final {np.mean(e['final']):.3f}{collapsed}"
            cells.append(f"**{cell}**" if analysed["chosen"].get(arm) == lr else cell)
        chosen = analysed["chosen"].get(arm)
        lines.append(f"| {arm} | {' | '.join(cells)} | {'-' if chosen is None else f'{chosen:g}'} |")
    return lines


def _edge_lines(analysed):
    lines = []
    edge = [arm for arm, m in analysed["arms"].items() if m["at_sweep_edge"]]
    if edge:
        lines += [
            "",
            "Chosen at the edge of the sweep (the lowest or the highest rate swept, so the best rate may lie outside "
            "it): " + ", ".join(f"{arm} ({analysed['arms'][arm]['lr']:g})" for arm in edge) + ".",
        ]
    if analysed["incomplete"]:
        gaps = "; ".join(
            f"{arm} (" + ", ".join(f"lr {lr:g} seed {seed}" for lr, seed in missing) + ")"
            for arm, missing in analysed["incomplete"].items()
        )
        lines += ["", f"Sweep not complete, so no rate chosen and no study yet: {gaps} still to run."]
    return lines


def _collapse_lines(analysed):
    head = (
        f"**Collapsed runs** (final held-out greedy more than {COLLAPSE} below the warm start's "
        f"{analysed['warm_start']:.3f}):"
    )
    if analysed["collapses"]:
        runs = [
            f"{c['arm']} lr {c['lr']:g} seed {c['seed']} ({c['phase']}): {c['final']:.3f}"
            for c in analysed["collapses"]
        ]
        counts = {}
        for c in analysed["collapses"]:
            counts[c["arm"]] = counts.get(c["arm"], 0) + 1
        per_arm = ", ".join(f"{arm} {n}" for arm, n in counts.items())
        lines = [f"{head} {len(runs)} (per arm: {per_arm}): " + "; ".join(runs) + "."]
    else:
        lines = [f"{head} none."]
    if analysed["stopped"]:
        stopped = "; ".join(
            f"{r['arm']} lr {r['lr']:g} seed {r['seed']} ({r['phase']}) after step {r['steps']}"
            for r in analysed["stopped"]
        )
        lines += [
            "",
            "Stopped at the run cap (bench_speed.py's `--run-cap`: a collapsed policy whose groups are all flat, which "
            f"dynamic filtering drops and draws again, generates for ever): {stopped}. The last evaluation of each "
            "stands as its final accuracy.",
        ]
    return lines


def _arm_lines(analysed):
    grpo_wall = analysed["grpo_wall"]
    at = "-" if grpo_wall is None else f"{grpo_wall:.0f} s"
    lines = [
        f"**At the chosen rates.** Accuracy at GRPO's seed-mean total wall time ({at}; an arm that ended sooner "
        "keeps its last accuracy), the area under the curve up to it, and the step costs (the seed-mean step time "
        "and its shares: generation, experience making, training; the rest is the weight broadcast; then the "
        "machine's speed, which drifted between batches of runs: seconds of training per step, equal work for "
        "arms that train the same schedule, and seconds of generation per million generated tokens):",
        "",
        "| arm | lr | seeds | final greedy | collapsed | greedy at GRPO's wall time | area to it | total wall s "
        "| step s | generation | experience | training | training s / step | generation s / M tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, m in analysed["arms"].items():
        costs = m["costs"]
        at_wall = "-" if m["at_grpo_wall"] is None else mean_std(m["at_grpo_wall"])
        area = "-" if m["area"] is None else mean_std(m["area"])
        lines.append(
            f"| {arm} | {m['lr']:g} | {', '.join(map(str, m['seeds']))} | {mean_std(m['final'])} | "
            f"{len(m['collapsed'])} | {at_wall} | {area} | {m['total_wall']:.0f} | {costs['step']:.2f} | "
            f"{costs['generation']:.0%} | {costs['experience']:.0%} | {costs['training']:.0%} | "
            f"{costs['training_s']:.2f} | {costs['generation_s_per_mtoken']:.0f} |"
        )
    return lines


def _skip_lines(analysed):
    skipping = {arm: m["costs"]["skipped"] for arm, m in analysed["arms"].items() if m["costs"]["skipped"]}
    if not skipping:
        return []
    return [
        "**Prompts skipped** by the history prior per step, seed mean: "
        + ", ".join(f"{arm} {n:.1f}" for arm, n in skipping.items())
        + "."
    ]


def _time_lines(analysed):
    lines = [
        "**Time to each threshold** (seed mean with its 95% t-interval over seeds; interpolated linearly "
        "between evaluations; a seed that never reached the threshold counts at its run's end, which makes the mean "
        "a lower bound, marked >=):",
        "",
        "| threshold | arm | never reached | " + " | ".join(CLOCK_COLUMNS[c] for c in CLOCKS) + " |",
        "|---|---|---|---|---|---|",
    ]
    for i, level in enumerate(analysed["thresholds"]):
        for arm, m in analysed["arms"].items():
            censored = sum(c for _, c in m["times"][i]["step"])
            pattern = {"step": "{:.1f}", "wall": "{:.0f}", "generated": "{:,.0f}"}
            cells = [m["mean_times"][i][clock].text(pattern[clock]) for clock in CLOCKS]
            lines.append(f"| {level:.3f} | {arm} | {censored} of {len(m['seeds'])} | {' | '.join(cells)} |")
    first = [
        sum(m["first_evaluation"][i] for m in analysed["arms"].values()) for i in range(len(analysed["thresholds"]))
    ]
    runs = sum(len(m["seeds"]) for m in analysed["arms"].values())
    if any(first):
        counts = ", ".join(f"{level:.3f}: {n} of {runs}" for level, n in zip(analysed["thresholds"], first))
        lines += [
            "",
            f"Runs that first reached a threshold at the first evaluation, so that its time above interpolates from "
            f"the warm start and reads that evaluation's accuracy more than a time: {counts}.",
        ]
    return lines


def _ratio_lines(analysed, base):
    grpo = analysed["arms"][base]
    lines = [
        f"**Ratios to {base}** (lr {grpo['lr']:g}): the arm's geometric seed-mean time over {base}'s, with the 95% "
        "Welch t-interval of the log ratio (>=: a lower bound, the arm had censored seeds; "
        "<=: an upper bound, the baseline had); overlap: whether the two seed-mean intervals of the time above "
        "overlap (unknown where a censored one may still move):",
        "",
        "| threshold | arm | " + " | ".join(f"{CLOCK_COLUMNS[c]} | overlap" for c in CLOCKS) + " |",
        "|---" * (2 + 2 * len(CLOCKS)) + "|",
    ]
    for i, level in enumerate(analysed["thresholds"]):
        for arm, m in analysed["arms"].items():
            if arm == base or base not in m["ratios"]:
                continue
            cells = [f"{m['ratios'][base][i][c].text()} | {m['overlap'][base][i][c]}" for c in CLOCKS]
            lines.append(f"| {level:.3f} | {arm} | {' | '.join(cells)} |")
    return lines


def _replay_lines(analysed):
    """Each rerun's times over its arm's: the same arm, rate and seeds timed twice, so the size of difference two
    arms' ratios must exceed before they say anything (runs do not replay bit for bit)."""
    arms = analysed["arms"]
    replays = []
    for arm, m in arms.items():
        base = arm.removesuffix(RERUN)
        if arm != base and base in m["ratios"]:
            ratios = m["ratios"][base]
            wall, steps = (" / ".join(r[clock].text() for r in ratios) for clock in ("wall", "step"))
            replays.append(f"`{arm}` took {wall} of {base}'s wall time ({steps} of its steps)")
    if not replays:
        return []
    return [
        f"**Replays** (the same arm, rate and seeds run twice; runs do not replay bit for bit): {'; '.join(replays)}, "
        "to the thresholds in turn. A ratio between two arms within that spread is no more than one arm timed twice."
    ]


def _study_seed_lines(analysed, base):
    """The ratios on the seeds that chose no rate, where other seeds count in the ratio tables too."""
    arms = {
        arm: m
        for arm, m in analysed["arms"].items()
        if arm != base
        and base in m["study_ratios"]
        and (m["study_seeds"], analysed["arms"][base]["study_seeds"]) != (m["seeds"], analysed["arms"][base]["seeds"])
    }
    if not arms:
        return []
    seeds = ", ".join(map(str, analysed["arms"][base]["study_seeds"]))
    lines = [
        f"**Wall-time ratios to {base} on the study's seeds alone** ({seeds}; the rates were chosen on the sweep's "
        "seeds, which count above too, so these are free of that choice):",
        "",
        "| threshold | " + " | ".join(arms) + " |",
        "|---" * (1 + len(arms)) + "|",
    ]
    for i, level in enumerate(analysed["thresholds"]):
        lines.append(f"| {level:.3f} | " + " | ".join(m["study_ratios"][base][i].text() for m in arms.values()) + " |")
    return lines


def ratio_bases():
    """The arms of the ratio tables, in their order: the baselines, then each arm that another extends, its rerun
    (timed in the extending arm's batch) first."""
    return [*BASELINES, *(arm for base in dict.fromkeys(EXTENDS.values()) for arm in (base + RERUN, base))]


def regime_lines(document, analysed, heading):
    """One task and regime's lines, with a ratio table to each of :func:`ratio_bases` that another arm has ratios
    to."""
    task, regime = analysed["task"], analysed["regime"]
    title = REGIME_TITLES[regime].format(pool=document["protocol"]["pool"])
    spec = document["tasks"][task]
    fractions = " / ".join(f"{f:.0%}" for f in document["protocol"]["fractions"])
    lines = [
        f"{heading} `{_task_name(task)}`, {title}",
        "",
        f"Warm start: held-out greedy {analysed['warm_start']:.3f} on {spec['task_config']['n_heldout']} prompts. "
        f"Thresholds, fixed before the runs (warm start + {fractions} of the gap to 1.0): "
        + ", ".join(f"{level:.3f}" for level in analysed["thresholds"])
        + ".",
        "",
        *_sweep_lines(analysed),
        *_edge_lines(analysed),
        "",
        *_collapse_lines(analysed),
    ]
    if not analysed["arms"]:
        return lines
    lines += ["", *_arm_lines(analysed)]
    skipped = _skip_lines(analysed)
    lines += ["", *skipped] if skipped else []
    lines += ["", *_time_lines(analysed)]
    arms = analysed["arms"]
    for base in (b for b in ratio_bases() if any(b in m["ratios"] for arm, m in arms.items() if arm != b)):
        lines += ["", *_ratio_lines(analysed, base)]
        study_seeds = _study_seed_lines(analysed, base)
        lines += ["", *study_seeds] if study_seeds else []
    replays = _replay_lines(analysed)
    return lines + (["", *replays] if replays else [])


def _phase_command(runs, phase, protocol, name):
    """The bench_speed.py command of one ``phase`` of the study ``name`` (``fixed-rate``, ``sweep`` or ``study``);
    the study's names the sweep's rates and seeds, from which it takes each arm's rate."""
    mine = [run for run in runs if run["phase"] == phase]
    sweep = [run for run in runs if run["phase"] == "sweep"]
    flags = dict(
        name=name,
        tasks=" ".join(dict.fromkeys(run["task"] for run in mine)),
        regimes=" ".join(dict.fromkeys(run["regime"] for run in mine)),
        phases=phase,
        fixed_lr=phase == FIXED_RATE and f"{mine[0]['lr']:g}",
        lrs=phase != FIXED_RATE and " ".join(f"{lr:g}" for lr in sorted({run["lr"] for run in sweep})),
        sweep_seeds=phase != FIXED_RATE and " ".join(map(str, sorted({run["seed"] for run in sweep}))),
        seeds=phase != "sweep" and " ".join(map(str, sorted({run["seed"] for run in mine}))),
        eval_early=protocol.get("eval_early") and " ".join(map(str, protocol["eval_early"])),
        micro_batch=protocol.get("micro_batch"),
        arms=" ".join(dict.fromkeys(run["arm"] for run in mine)),
    )
    given = " ".join(f"--{flag.replace('_', '-')} {value}" for flag, value in flags.items() if value)
    return f"`.venv/bin/python benchmarks/bench_speed.py {given}`"


def _commands(runs, protocol, name):
    """The commands that ran ``runs`` (of the study ``name``): the study's (the sweep, then the study), then those of
    the arms and reruns named apart; or, for a study with arms at one given rate, each phase's own, per task and
    regime (each has its own given rate)."""
    if any(run["phase"] == FIXED_RATE for run in runs):
        commands = []
        for cell in dict.fromkeys((run["task"], run["regime"]) for run in runs):
            mine = [run for run in runs if (run["task"], run["regime"]) == cell]
            phases = [phase for phase in (FIXED_RATE, "sweep", "study") if any(run["phase"] == phase for run in mine)]
            commands += [_phase_command(mine, phase, protocol, name) for phase in phases]
        return f"{', then '.join(commands)} (each run appended as it ends; see its docstring)"
    named = [arm for arm in dict.fromkeys(run["arm"] for run in runs) if arm in EXTENDS]
    reruns = list(dict.fromkeys(run["arm"] for run in runs if run["phase"] == "rerun"))
    extra = [f"`--arms {' '.join(named)}`"] if named else []
    extra += [f"`--arms {' '.join(reruns)} --phases rerun`"] if reruns else []
    study = f"{COMMAND} (the sweep, then the study, each run appended as it ends; see its docstring)"
    return study + "".join(f", then {command}" for command in extra)


def speed_body(document, analyses, plots, heading="###", name="speed_study"):
    """The lines of the study ``name``; ``plots``: regime -> (the study's plot, every run's plot), as the document
    links them."""
    runs = document["runs"]
    protocol = document["protocol"]
    tasks = document["tasks"].values()
    dates = sorted({run["date"] for run in runs} | {t["date"] for t in tasks})
    machines = sorted({run["machine"] for run in runs})
    minutes = (
        sum(run["process_seconds"] + run["eval_seconds"] for run in runs)
        + sum((t["sft_seconds"] or 0.0) + sum(r["sft_seconds"] for r in t.get("sft_remade", ())) for t in tasks)
    ) / 60
    seeds = sorted({run["seed"] for run in runs})
    lrs = sorted({run["lr"] for run in runs})
    early = protocol.get("eval_early")
    every = f"every {protocol['eval_every']} steps" + (
        f" (and every {early[0]} up to step {early[1]})" if early else ""
    )
    swept = list(dict.fromkeys(run["arm"] for run in runs if run["phase"] == "sweep"))
    if not swept:
        rates = "every arm at the one rate given"
    elif all(run["phase"] != FIXED_RATE for run in runs):
        rates = "each at the rate its sweep chose; the sweep's seeds at that rate count in the study"
    else:
        rates = (
            f"{', '.join(swept)} each at the rate its sweep chose (the sweep's seeds at that rate count too, and the "
            "runs at the one rate given where the sweep chose it), the other arms at the one rate given"
        )
    micro = protocol.get("micro_batch")
    lines = [
        f"Command: {_commands(runs, protocol, name)}, then `benchmarks/report.py`. "
        f"Machine: {'; '.join(machines)}. Dates: {dates[0]} to {dates[-1]}. Duration: {minutes:.0f} minutes of runs, "
        f"evaluations and warm starts ({len(runs)} runs). Seeds: {', '.join(map(str, seeds))}; rates: "
        f"{', '.join(f'{lr:g}' for lr in lrs)}.",
        "",
        f"Every arm trains {protocol['steps']} steps of {protocol['prompts_per_step']} prompts x G = 16 rollouts "
        f"(`--d3s.schedule_steps`)"
        + (f", micro-batches of {micro}" if micro else "")
        + f"; held-out greedy accuracy {every} from saved checkpoints; wall time is the sum of the steps' "
        "`timing/step_total` (Ray and vLLM start-up, checkpoint saving and the evaluations excluded); generated "
        "tokens count every response generated. Arms: "
        + ", ".join(ARM_TEXT.get(arm, arm) for arm in dict.fromkeys(run["arm"] for run in runs))
        + f"; {rates}.",
    ]
    reruns = list(dict.fromkeys(run["arm"] + RERUN for run in runs if run["phase"] == "rerun"))
    if reruns:
        lines += [
            "",
            f"{', '.join(f'`{arm}`' for arm in reruns)}: the arm timed again at its chosen rate in a later batch of "
            "runs (`--phases rerun`; no part in the choice of rate). The machine's speed drifted 10-25% per "
            "generated token between batches, so an arm run in a later batch ("
            + ", ".join(f"{arm}, beside {base}" for arm, base in EXTENDS.items())
            + ") is compared with the rerun of its base, free of that drift; its step and token ratios carry none.",
        ]
    for regime, (study_png, runs_png) in plots.items():
        if study_png:
            lines += ["", f"![the study's curves, {regime}]({study_png})"]
        lines += ["", f"![every run, {regime}]({runs_png})"]
    for analysed in analyses:
        lines += ["", *regime_lines(document, analysed, heading)]
    if protocol["quick"]:
        lines += ["", "This is a smoke test (`--quick`): too few steps, prompts and seeds for any conclusion."]
    return lines


def write_plots(document, analyses, directory, prefix):
    """The plots of every regime in ``directory``; regime -> (study plot name, None before any rate is chosen;
    every-run plot name)."""
    plots = {}
    for regime in dict.fromkeys(a["regime"] for a in analyses):
        study, runs = f"{prefix}_{regime}.png", f"{prefix}_runs_{regime}.png"
        if any(a["arms"] for a in analyses if a["regime"] == regime):
            plot_study(document, analyses, regime, Path(directory) / study)
        else:
            study = None
        plot_runs(document, analyses, regime, Path(directory) / runs)
        plots[regime] = (study, runs)
    return plots


def speed_section(path, number):
    """RESULTS.md's section of a study of bench_speed.py (``SECTIONS``: ``speed_study.json``, ``equal_updates.json``;
    its plots written beside it, linked as ``results/...``) and its lines in RESULTS.md's head: ``(section,
    head)``; the command to run where the file is missing."""
    stem = Path(path).stem
    heading, label, command = SECTIONS[stem]
    title = f"## {number}. {heading}"
    if not Path(path).exists():
        return [title, "", f"Not run yet: {command}, then `report.py`."], []
    document = json.loads(Path(path).read_text())
    analyses = speed_analysis(document)
    plots = write_plots(document, analyses, Path(path).parent, stem)
    linked = {regime: tuple(name and f"results/{name}" for name in names) for regime, names in plots.items()}
    body = speed_body(document, analyses, linked, name=stem)
    return [title, "", *body], head_lines(document, analyses, number, label)


def head_lines(document, analyses, number, label="Speed"):
    """Per task and regime with arms at their chosen rates, each arm's wall time to each threshold as a ratio to
    its base (GRPO; for an arm that extends another, that arm's rerun where it ran, else that arm), with its
    interval, and which arms are faster or slower at every threshold; reruns are left out."""
    lines = []
    for analysed in analyses:
        arms = analysed["arms"]
        compared = {}  # arm -> its base
        for arm, m in arms.items():
            own = EXTENDS.get(arm)
            bases = ("GRPO",) if own is None else (own + RERUN, own)
            base = next((b for b in bases if b != arm and b in m["ratios"]), None)
            if base is not None and not arm.endswith(RERUN):
                compared[arm] = base
        # the seeds that took no part in choosing a rate, where every comparison has them
        unchosen = bool(compared) and all(base in arms[arm]["study_ratios"] for arm, base in compared.items())
        ratios, verdicts = [], {"faster": [], "slower": []}
        for arm, base in compared.items():
            m = arms[arm]
            walls = m["study_ratios"][base] if unchosen else [r["wall"] for r in m["ratios"][base]]
            ratios.append(f"{arm} to {base} " + " / ".join(r.text() for r in walls))
            if all(r.high < 1 and r.bound in ("=", "<=") for r in walls):
                verdicts["faster"].append(arm)
            elif all(r.low > 1 and r.bound in ("=", ">=") for r in walls):
                verdicts["slower"].append(arm)
        if not ratios:
            continue
        verdict = "; ".join(
            f"{word} than its base at every threshold (the whole interval {side} 1): {', '.join(names)}"
            for (word, side), names in zip((("faster", "below"), ("slower", "above")), verdicts.values())
            if names
        )
        used = {*compared, *compared.values()}
        seeds = ", ".join(
            map(str, sorted({s for a in used for s in arms[a]["study_seeds" if unchosen else "seeds"]}))
        ) + (" (no part in choosing a rate)" if unchosen else "")
        title = REGIME_TITLES[analysed["regime"]].format(pool=document["protocol"]["pool"])
        levels = " / ".join(f"{level:.3f}" for level in analysed["thresholds"])
        lines.append(
            f"- {label} (section {number}), `{_task_name(analysed['task'])}`, {title}, seeds {seeds}: wall time to "
            f"{levels} held-out greedy as a ratio (95% intervals): {'; '.join(ratios)}. "
            + (f"{verdict[0].upper()}{verdict[1:]}; every other" if verdict else "Every")
            + " arm's interval holds 1 at some threshold."
        )
    return lines


def speed_main(path, output):
    """The study of ``path`` alone, written to ``output`` with its plots beside it; returns ``output``."""
    document = json.loads(Path(path).read_text())
    analyses = speed_analysis(document)
    plots = write_plots(document, analyses, Path(output).parent, Path(output).stem)
    lines = ["# Speed to fixed accuracies", "", *speed_body(document, analyses, plots, "##", Path(path).stem)]
    Path(output).write_text("\n".join(lines) + "\n")
    print(f"wrote {output} and its plots")
    return output
