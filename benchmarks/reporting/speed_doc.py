"""The speed study in the documents (``speed_study.json``, benchmarks/bench_speed.py): per regime a plot of the study's
seed-mean curves with their seed range and a plot of every run's curve; per task and regime the learning-rate sweep
and its choice, the collapsed runs, each arm at its chosen rate, the times to the thresholds and their ratios to the
baselines. Two parts of one file, each its own RESULTS.md section: the study of the sample and token levels
(section 11) and the generation level's arms beside the arms they add it to (section 6, :func:`split`). It states
what was measured: no verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .speed import (
    BASELINES,
    CLOCKS,
    COLLAPSE,
    GENERATION_BASES,
    REFERENCE_LR,
    REMOVED_ARMS,
    RERUN,
    arm_runs,
    run_key,
    speed_analysis,
    value_at,
)
from .stats import mean_std
from .study_doc import STUDY_COLORS

REGIME_TITLES = {"passes": "several passes over {pool} prompts", "fresh": "one pass over fresh prompts"}
CLOCK_LABELS = {"step": "RL step", "wall": "wall time of the steps (s)", "generated": "generated response tokens"}
CLOCK_COLUMNS = {"step": "steps", "wall": "wall s", "generated": "generated tokens"}
LR_COLORS = ("tab:green", "tab:blue", "tab:red", "tab:purple", "tab:orange", "tab:brown")
GRID = 60  # points of the seed-mean curves on the wall-time and token clocks
ARM_COLORS = {
    **STUDY_COLORS,
    "GRPO+DF": "tab:red",
    "GRPO+screen": "tab:brown",
    "D3S+history": "tab:cyan",
    "D3S+screen4+history": "tab:purple",
    "D3S+screen8+history": "tab:olive",
    "D3S+screen4+pilot-history": "tab:pink",
}
_D3S = "N 4 -> 12, K 0.2 -> 0.5"
_AUDIT = "2% of the screened-out prompts audited"
ARM_TEXT = {  # the arms of speed_study.json, in words
    "GRPO+DF": "GRPO + DF (upstream's `--algo.dynamic_filtering_enable`)",
    "PODS": "PODS (n = 16, m = 4, max-variance)",
    "D3S": f"D3S ({_D3S})",
    "D3S-I": f"D3S-I ({_D3S}, intra-group)",
    "GRPO+screen": f"GRPO + screening (pilots of 4, {_AUDIT})",
    "D3S+history": "D3S + the history prior (`--d3s.prompt_skip history`)",
    "D3S+screen4+history": f"D3S + screening with pilots of 4 + the history prior ({_AUDIT})",
    "D3S+screen8+history": f"D3S + screening with pilots of 8 + the history prior ({_AUDIT})",
    "D3S+screen4+pilot-history": (
        "D3S + screening with pilots of 4 + the history prior, prompts known mixed without a pilot "
        f"(`--d3s.pilot_history`, removed after this study: it did not win; {_AUDIT})"
    ),
}


STUDY_COMMAND = "`.venv/bin/python benchmarks/bench_speed.py --out benchmarks/results`"
GENERATION_COMMAND = (
    "`.venv/bin/python benchmarks/bench_speed.py --out benchmarks/results --arms "
    + " ".join(arm for arm in GENERATION_BASES if arm not in REMOVED_ARMS)
    + "` (`--tasks d3s_openrlhf.tasks.chainsum`; `--regimes passes` for D3S + history, which acts only when prompts "
    "recur), and in the same batch `--arms D3S --phases rerun` (`--arms GRPO --phases rerun` with GRPO + screening); "
    + "; ".join(f"{arm} ran with `{flag}`, removed after this study" for arm, flag in REMOVED_ARMS.items())
)


def split(document):
    """``speed_study.json`` as its two parts: the study without the generation level's arms, and, per task and
    regime where such an arm ran, those arms beside GRPO and D3S (the arms they add their level to; GRPO's runs
    also set the sweep's budget) and their reruns (bench_speed.py --phases rerun); None where no such arm ran."""
    runs = document["runs"]
    where = {run_key(run) for run in runs if run["arm"] in GENERATION_BASES}
    beside = set(GENERATION_BASES) | set(GENERATION_BASES.values())
    study = {
        **document,
        "runs": [run for run in runs if run["arm"] not in GENERATION_BASES and run["phase"] != "rerun"],
    }
    level = [run for run in runs if run_key(run) in where and run["arm"] in beside]
    return study, ({**document, "runs": level} if level else None)


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


def _share(value, pattern="{:.0%}"):
    return "-" if value is None else pattern.format(value)


def _generation_lines(analysed):
    arms = {arm: m for arm, m in analysed["arms"].items() if m["generation"]}
    if not arms:
        return []
    lines = [
        "**The generation level** (over the arm's runs at its chosen rate): pilots per step and the share that "
        "passed; false rejects, the share of the audited screened-out prompts whose full group had variance (audits "
        "in brackets); prompts skipped per step; the trained groups generated whole because their record said mixed "
        "(and how many of those came out flat); the trained groups whose pilots were carried from the batch before, "
        "so generated by the policy one update older than the rest of their group; the mean screening weight; the "
        "share of a step spent generating:",
        "",
        "| arm | pilots / step | pilot acceptance | false rejects | skipped / step | generated whole (flat) | carried "
        "pilots | screen weight | generation |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, m in arms.items():
        g = m["generation"]
        rejects = "-" if g["false_rejects"] is None else f"{g['false_rejects'][0]:.0%} ({g['false_rejects'][1]})"
        whole = f"{g['unpiloted_share']:.0%} ({_share(g['unpiloted_flat'])})" if g["unpiloted_share"] else "-"
        lines.append(
            f"| {arm} | {g['pilots_per_step']:.1f} | {_share(g['acceptance'])} | {rejects} | "
            f"{g['skipped_per_step']:.1f} | {whole} | {g['carried_share']:.0%} | "
            f"{_share(g['screen_weight'], '{:.2f}')} | {m['costs']['generation']:.0%} |"
        )
    return lines


def _time_lines(analysed):
    lines = [
        "**Time to each threshold** (seed mean with its 95% bootstrap interval over seeds; interpolated linearly "
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
        f"**Ratios to {base}** (lr {grpo['lr']:g}): the arm's seed-mean time over {base}'s, with the 95% percentile "
        "interval of the ratio when both sides' seeds are resampled (>=: a lower bound, the arm had censored seeds; "
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
    arms = {arm: m for arm, m in analysed["arms"].items() if arm != base and base in m["study_ratios"]}
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


def regime_lines(document, analysed, heading, bases=BASELINES):
    """One task and regime's lines, with a ratio table to each of ``bases`` that another arm has ratios to."""
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
    generation = _generation_lines(analysed)
    lines += ["", *generation] if generation else []
    lines += ["", *_time_lines(analysed)]
    arms = analysed["arms"]
    for base in (b for b in bases if any(b in m["ratios"] for arm, m in arms.items() if arm != b)):
        lines += ["", *_ratio_lines(analysed, base)]
        study_seeds = _study_seed_lines(analysed, base)
        lines += ["", *study_seeds] if study_seeds else []
    replays = _replay_lines(analysed)
    return lines + (["", *replays] if replays else [])


def speed_body(document, analyses, plots, heading="###", command=STUDY_COMMAND, bases=BASELINES):
    """The study's lines; ``plots``: regime -> (the study's plot, every run's plot), as the document links them;
    ``command``: the one that runs these arms; ``bases``: the arms of the ratio tables."""
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
    lines = [
        f"Command: {command} (the sweep, then the study, "
        "each run appended as it ends; see its docstring), then `benchmarks/report.py`. "
        f"Machine: {'; '.join(machines)}. Dates: {dates[0]} to {dates[-1]}. Duration: {minutes:.0f} minutes of runs, "
        f"evaluations and warm starts ({len(runs)} runs). Seeds: {', '.join(map(str, seeds))}; rates: "
        f"{', '.join(f'{lr:g}' for lr in lrs)}.",
        "",
        f"Every arm trains {protocol['steps']} steps of {protocol['prompts_per_step']} prompts x G = 16 rollouts "
        "(`--d3s.schedule_steps`); held-out greedy accuracy every "
        f"{protocol['eval_every']} steps from saved checkpoints; wall time is the sum of the steps' "
        "`timing/step_total` (Ray and vLLM start-up, checkpoint saving and the evaluations excluded); generated "
        "tokens count every response generated. Arms: "
        + ", ".join(ARM_TEXT.get(arm, arm) for arm in dict.fromkeys(run["arm"] for run in runs))
        + "; each at the rate its sweep chose; the sweep's seeds at that rate count in the study.",
    ]
    for regime, (study_png, runs_png) in plots.items():
        if study_png:
            lines += ["", f"![the study's curves, {regime}]({study_png})"]
        lines += ["", f"![every run, {regime}]({runs_png})"]
    for analysed in analyses:
        lines += ["", *regime_lines(document, analysed, heading, bases)]
    if document["protocol"].get("quick"):
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


def _linked(plots):
    return {regime: tuple(name and f"results/{name}" for name in names) for regime, names in plots.items()}


def _not_run(title, command):
    return [title, "", f"Not run yet: {command}, then `report.py`."], []


def speed_section(path, number):
    """The RESULTS.md section of ``speed_study.json``'s study without the generation level's arms (its plots
    written beside it, linked as ``results/...``) and its lines in RESULTS.md's summary: ``(section, summary)``;
    the command to run where the file is missing."""
    title = f"## {number}. Speed to fixed accuracies, each arm at its tuned learning rate"
    if not Path(path).exists():
        return _not_run(title, f"{STUDY_COMMAND} (about 9 hours on 2 CPU cores; it appends run by run and resumes)")
    document, _ = split(json.loads(Path(path).read_text()))
    analyses = speed_analysis(document)
    plots = write_plots(document, analyses, Path(path).parent, "speed_study")
    summary = _summary_lines(document, analyses, number, lambda arm: ("GRPO",))
    return [title, "", *speed_body(document, analyses, _linked(plots))], summary


def generation_level_section(path, number):
    """The RESULTS.md section of ``speed_study.json``'s generation-level arms beside the arms they add their level
    to, as :func:`speed_section`; the command to run where none of them ran."""
    title = f"## {number}. The generation level on the speed protocol: screening, the history prior, pilot history"
    document = split(json.loads(Path(path).read_text()))[1] if Path(path).exists() else None
    if document is None:
        return _not_run(title, GENERATION_COMMAND)
    analyses = speed_analysis(document)
    plots = write_plots(document, analyses, Path(path).parent, "generation_level")
    summary = _summary_lines(document, analyses, number, _level_bases)
    return [title, "", *level_body(document, analyses, _linked(plots))], summary


def level_body(document, analyses, plots, heading="###"):
    """:func:`speed_body` for the generation level: its command, and ratios to D3S (and its rerun) beside those to
    GRPO."""
    reruns = list(dict.fromkeys(arm for a in analyses for arm in a["arms"] if arm.endswith(RERUN)))
    if reruns:
        drift = (
            f"so {' and '.join(f'`{arm}`' for arm in reruns)} timed the base again at its chosen rate in their batch: "
            "the wall-time ratios to it are free of the drift; those to GRPO and D3S, and the accuracy at GRPO's "
            "wall time, carry it"
        )
    else:
        drift = "and no base was timed again in their batch yet (`--phases rerun`): every wall-time figure carries it"
    lines = [
        "Each arm of the generation level beside the arm it adds its level to (D3S, or GRPO for GRPO + screening), "
        "on the protocol of section 11, its own learning rate swept; GRPO's and D3S's runs are section 11's. The "
        "machine's speed drifted 10-25% per generated token between batches of runs, and these arms ran in later "
        f"batches than the study, {drift} (the columns of training seconds per step say by how much). The step "
        "and token ratios carry none.",
        "",
    ]
    bases = ("D3S" + RERUN, "D3S", "GRPO" + RERUN, "GRPO")
    return lines + speed_body(document, analyses, plots, heading, GENERATION_COMMAND, bases)


def _level_bases(arm):
    """The arms an arm of the generation level is compared with, the one timed in its batch first."""
    base = GENERATION_BASES.get(arm)
    return () if base is None else (base + RERUN, base)


def _summary_lines(document, analyses, number, bases_of):
    """Per task and regime with arms at their chosen rates, every arm's wall time to each threshold as a ratio to
    its base's (the first of ``bases_of(arm)`` with a ratio), with its interval."""
    lines = []
    for analysed in analyses:
        arms = analysed["arms"]
        ratios = []
        for arm, m in arms.items():
            base = next((b for b in bases_of(arm) if b != arm and b in m["ratios"]), None)
            if base is not None:
                ratios.append(f"{arm} to {base} " + " / ".join(r["wall"].text() for r in m["ratios"][base]))
        if not ratios:
            continue
        seeds = ", ".join(map(str, sorted({seed for m in arms.values() for seed in m["seeds"]})))
        title = REGIME_TITLES[analysed["regime"]].format(pool=document["protocol"]["pool"])
        levels = " / ".join(f"{level:.3f}" for level in analysed["thresholds"])
        lines.append(
            f"- Section {number}, `{_task_name(analysed['task'])}`, {title}, each arm at its tuned rate, seeds "
            f"{seeds}: wall time to {levels} held-out greedy as a ratio (95% intervals): {'; '.join(ratios)}."
        )
    return lines


def speed_main(path, output):
    """The study alone, then its generation-level arms where they ran, written to ``output`` with the plots beside
    it; returns ``output``."""
    study, level = split(json.loads(Path(path).read_text()))
    analyses = speed_analysis(study)
    plots = write_plots(study, analyses, Path(output).parent, Path(output).stem)
    lines = ["# Speed to fixed accuracies", "", *speed_body(study, analyses, plots, "##")]
    if level is not None:
        analyses = speed_analysis(level)
        plots = write_plots(level, analyses, Path(output).parent, "generation_level")  # the plots section 6 links
        lines += ["", "# The generation level", "", *level_body(level, analyses, plots, "##")]
    Path(output).write_text("\n".join(lines) + "\n")
    print(f"wrote {output} and its plots")
    return output
