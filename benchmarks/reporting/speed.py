"""The speed study's analysis (``speed_study.json``, benchmarks/bench_speed.py): pure functions of the recorded
held-out curves, and :func:`speed_analysis`, which applies them per task and regime.

A run's curve is its held-out greedy accuracy at the warm start (step 0) and every evaluation, each point with
three clocks: the step, the wall time (the sum of the steps' ``timing/step_total``: Ray, vLLM and checkpoint
saving excluded) and the generated response tokens so far. Between evaluations the curve is linear; after the
run's end it stays at its last value (the model a run has at a later time is its last one).

- **Time to a threshold** (:func:`time_to`): where the curve first reaches it, interpolated linearly between the
  two evaluations around the crossing. A run that never reaches it is **censored** at its end: its value is the
  run's end on that clock and a lower bound on the truth.
- **Censored values in means and ratios** (:class:`Interval`): a mean over seeds with a censored seed is a lower
  bound (``>=``); the ratio of an arm's mean to a baseline's is a lower bound where only the arm has censored
  seeds, an upper bound (``<=``) where only the baseline has, and unknown where both have. Every bootstrap
  resample's value is bounded the same way, so the interval's ends carry the same bound.
- **Area under the curve up to a budget** (:func:`area`): the mean held-out greedy accuracy over wall time
  ``[0, budget]``.
- **The learning rate** (:func:`choose_lr`): per task, regime and arm, the rate of the sweep with the highest
  seed-mean area up to the sweep's budget: GRPO's seed-mean total wall time at today's rate (``REFERENCE_LR``),
  one budget shared by every arm and rate of that task and regime.
- **A collapsed run** (:func:`collapsed`): its final held-out greedy accuracy is more than ``COLLAPSE`` below the
  warm start's.
- **Reruns**: an arm timed again at its chosen rate in a later batch (phase ``rerun``) is reported as an arm of its
  own (``RERUN``) and takes no part in the choice: the arms of that batch are compared with it, free of the
  machine's drift between batches.
- **What limits a reading**, counted for the report: thresholds first reached at the first evaluation (their time
  interpolates from the warm start, :func:`before_first_evaluation`), and chosen rates at the sweep's edge
  (:func:`at_sweep_edge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

COLLAPSE = 0.1  # a run whose final greedy accuracy ends more than this below the warm start's has collapsed
REFERENCE_LR = 2e-4  # today's rate: GRPO's total wall time at it is the sweep's budget
CLOCKS = ("step", "wall", "generated")
BASELINES = ("GRPO", "GRPO+DF")
# the generation level's arms (bench_learning.PARTS["speed"], and the REMOVED_ARMS below) -> the arm each adds its
# level to: its ratios are taken to that arm too, and the documents report them apart (RESULTS.md section 6)
GENERATION_BASES = {
    "GRPO+screen": "GRPO",
    "D3S+history": "D3S",
    "D3S+screen4+history": "D3S",
    "D3S+screen8+history": "D3S",
    "D3S+screen4+pilot-history": "D3S",
}
# arms whose flag was removed after their runs were recorded -> that flag: reported, no longer run
REMOVED_ARMS = {"D3S+screen4+pilot-history": "--d3s.pilot_history"}
# an arm timed again at its chosen rate in a later batch (bench_speed.py --phases rerun) is reported as this arm,
# beside the arms of that batch: the machine's speed drifted 10-25% between batches (2026-11-27)
RERUN = " rerun"  # the suffix of such an arm's name
ALPHA = 0.05
RESAMPLES = 2000  # bootstrap resamples of the seeds


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


@dataclass(frozen=True)
class Interval:
    """A point estimate and its 95% bootstrap interval; ``bound``: ``"="`` (measured), ``">="`` (point and ends are
    lower bounds), ``"<="`` (upper bounds) or ``"?"`` (censored on both sides of a ratio: no bound)."""

    point: float
    low: float
    high: float
    bound: str = "="

    def text(self, pattern="{:.2f}"):
        if self.bound == "?":
            return "- (censored in both)"
        if math.isnan(self.point):
            return "-"
        mark = "" if self.bound == "=" else self.bound
        low, high = (f"{mark}{pattern.format(v)}" for v in (self.low, self.high))
        return f"{mark}{pattern.format(self.point)} [{low}, {high}]"


def _percentiles(draws):
    draws = np.asarray(draws, dtype=float)
    draws = draws[np.isfinite(draws)]
    if not len(draws):
        return float("nan"), float("nan")
    return tuple(
        float(v) for v in np.percentile(draws, [100 * ALPHA / 2, 100 * (1 - ALPHA / 2)], method="inverted_cdf")
    )


def bootstrap_mean(values, rng, resamples=RESAMPLES):
    """The seed mean of ``values`` (``(value, censored)`` per seed) with its bootstrap interval; a lower bound if a
    seed is censored."""
    points = np.array([v for v, _ in values], dtype=float)
    draws = points[rng.integers(0, len(points), (resamples, len(points)))].mean(axis=1)
    bound = ">=" if any(c for _, c in values) else "="
    return Interval(float(points.mean()), *_percentiles(draws), bound)


def bootstrap_ratio(arm, base, rng, resamples=RESAMPLES):
    """The arm's seed mean over the baseline's (``(value, censored)`` per seed each), with a percentile interval
    from resampling each side's seeds independently; bounded as :class:`Interval` says."""
    a, b = (np.array([v for v, _ in values], dtype=float) for values in (arm, base))
    censored = (any(c for _, c in arm), any(c for _, c in base))
    bound = {(False, False): "=", (True, False): ">=", (False, True): "<=", (True, True): "?"}[censored]
    with np.errstate(divide="ignore", invalid="ignore"):
        point = a.mean() / b.mean()
        draws = a[rng.integers(0, len(a), (resamples, len(a)))].mean(axis=1) / b[
            rng.integers(0, len(b), (resamples, len(b)))
        ].mean(axis=1)
    if not np.isfinite(point):  # the baseline's mean is 0: it had the threshold at the warm start
        return Interval(float("nan"), float("nan"), float("nan"), bound)
    return Interval(float(point), *_percentiles(draws), bound)


def overlap(a, b):
    """Whether two seed-mean intervals (:func:`bootstrap_mean`, measured or lower bounds) overlap: ``"yes"``,
    ``"no"`` or ``"unknown"`` (a censored interval may still move up)."""
    if a.bound == b.bound == "=":
        return "yes" if a.low <= b.high and b.low <= a.high else "no"
    if a.bound == b.bound == ">=":
        return "unknown"
    exact, bounded = (a, b) if a.bound == "=" else (b, a)
    return "no" if bounded.low > exact.high else "unknown"  # already above, and it can only move up


# -- the document --------------------------------------------------------------------------------------------------
def run_key(run):
    """A run's (task, regime)."""
    return run["task"], run["regime"]


def step_costs(runs):
    """Seed means of a run's mean step time and the shares of it spent generating, making experience and training
    (the rest: the weight broadcast); and two readings of the machine's speed: seconds of training per step
    (``training_s``: equal work per step for arms that train the same schedule, as D3S and D3S + a generation
    level) and seconds of generation per million generated tokens (``generation_s_per_mtoken``)."""
    totals = {key: [] for key in ("step", "generation", "experience", "training", "training_s")}
    totals["generation_s_per_mtoken"] = []
    for run in runs:
        steps = run["steps"]
        total = sum(steps["timing/step_total"])
        totals["step"].append(total / len(steps["timing/step_total"]))
        totals["training_s"].append(sum(steps["timing/ppo_train"]) / len(steps["timing/ppo_train"]))
        totals["generation_s_per_mtoken"].append(sum(steps["timing/generation"]) / steps["generated"][-1] * 1e6)
        for name, key in (
            ("generation", "timing/generation"),
            ("experience", "timing/make_experience"),
            ("training", "timing/ppo_train"),
        ):
            totals[name].append(sum(steps[key]) / total)
    return {name: float(np.mean(values)) for name, values in totals.items()}


def _total(runs, key):
    return float(sum(sum(run["steps"].get(key, ())) for run in runs))


def generation_level(runs, batch):
    """What an arm's generation level did over its runs (None for an arm without one): pilots per step and the
    share that passed, the audited false rejects (screened-out prompts whose full group had variance), prompts
    skipped per step, the shares of the trained groups generated whole (``--d3s.pilot_history``: runs recorded
    before that flag was removed) and made of pilots carried from the batch before (one policy update old), and the
    mean screening weight. Per-step counts as bench_speed.py keeps them; ``batch``: the prompts of a step."""
    keys = {key for run in runs for key in run["steps"]}
    if not keys & {"d3s/pilots", "d3s/skipped_prompts"}:
        return None
    steps = sum(len(run["steps"]["timing/step_total"]) for run in runs)
    pilots, screened = _total(runs, "d3s/pilots"), _total(runs, "d3s/screened_prompts")
    audited = _total(runs, "d3s/audited_prompts")
    unpiloted = _total(runs, "d3s/unpiloted_groups")
    weights = [w for run in runs for w in run["steps"].get("d3s/screen_weight_mean", ()) if w]
    return dict(
        pilots_per_step=pilots / steps,
        acceptance=1.0 - screened / pilots if pilots else None,
        false_rejects=(_total(runs, "d3s/false_rejects") / audited, int(audited)) if audited else None,
        skipped_per_step=_total(runs, "d3s/skipped_prompts") / steps,
        unpiloted_share=unpiloted / (steps * batch),
        unpiloted_flat=_total(runs, "d3s/unpiloted_flat") / unpiloted if unpiloted else None,
        carried_share=_total(runs, "d3s/carried_pilots") / (steps * batch),
        screen_weight=float(np.mean(weights)) if weights else None,
    )


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


def arm_analysis(runs, levels, grpo_wall, warm_start, batch):
    """One arm's study runs (its chosen rate): final accuracy, collapses, times to each threshold per clock,
    accuracy at and area up to GRPO's total wall time (None without GRPO), step costs, the generation level's
    counts (:func:`generation_level`; ``batch``: prompts per step)."""
    times = [{clock: [time_to(run["curve"], level, clock) for run in runs] for clock in CLOCKS} for level in levels]
    rng = np.random.default_rng(0)
    return dict(
        seeds=sorted(run["seed"] for run in runs),
        final=[run["curve"][-1]["greedy"] for run in runs],
        collapsed=[run["seed"] for run in runs if collapsed(run["curve"], warm_start)],
        total_wall=float(np.mean([run["curve"][-1]["wall"] for run in runs])),
        times=times,
        mean_times=[{clock: bootstrap_mean(level[clock], rng) for clock in CLOCKS} for level in times],
        first_evaluation=[sum(before_first_evaluation(run["curve"], level) for run in runs) for level in levels],
        at_grpo_wall=None if grpo_wall is None else [value_at(run["curve"], "wall", grpo_wall) for run in runs],
        area=None if grpo_wall is None else [area(run["curve"], grpo_wall) for run in runs],
        costs=step_costs(runs),
        generation=generation_level(runs, batch),
    )


def _bases(arm, arms):
    """The arms of ``arms`` that ``arm``'s times are divided by: the baselines; for an arm of the generation level
    the arm it adds its level to, and that arm's rerun; for a rerun the arm it times again."""
    own = GENERATION_BASES.get(arm)
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
    arm_lr = {**chosen, **{arm + RERUN: lr for arm, lr in chosen.items()}}
    study = {arm: mine for arm, lr in arm_lr.items() if (mine := arm_runs(every, arm, lr))}
    grpo_wall = float(np.mean([run["curve"][-1]["wall"] for run in study["GRPO"]])) if "GRPO" in study else None
    batch = document["protocol"]["prompts_per_step"]
    arms = {arm: arm_analysis(runs, levels, grpo_wall, warm_start, batch) for arm, runs in study.items()}
    for arm, m in arms.items():
        m["lr"] = arm_lr[arm]
        m["at_sweep_edge"] = arm in chosen and at_sweep_edge(chosen[arm], list(sweep[arm]))
        m["ratios"], m["overlap"] = {}, {}
        for base in _bases(arm, arms):
            rng = np.random.default_rng(0)
            m["ratios"][base] = [
                {clock: bootstrap_ratio(mine[clock], theirs[clock], rng) for clock in CLOCKS}
                for mine, theirs in zip(m["times"], arms[base]["times"])
            ]
            m["overlap"][base] = [
                {clock: overlap(mine[clock], theirs[clock]) for clock in CLOCKS}
                for mine, theirs in zip(m["mean_times"], arms[base]["mean_times"])
            ]
    # the rates were chosen on the sweep's seeds, which then count in the study: the study's own seeds alone
    # are free of that selection (wall clock)
    fresh = {arm: [run for run in runs if run["phase"] == "study"] for arm, runs in study.items()}
    for arm, m in arms.items():
        m["study_seeds"] = sorted(run["seed"] for run in fresh[arm])
        m["study_ratios"] = {}
        for base in (b for b in _bases(arm, arms) if fresh[b] and fresh[arm]):
            rng = np.random.default_rng(0)
            m["study_ratios"][base] = [
                bootstrap_ratio(*([time_to(run["curve"], level, "wall") for run in fresh[a]] for a in (arm, base)), rng)
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
            steps=len(run["steps"]["timing/step_total"]),
        )
        for run in every
        if run.get("stopped")
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
