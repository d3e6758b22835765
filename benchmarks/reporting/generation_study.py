"""The generation level's study at fixed steps (``bench_learning.py --parts screen``: ``generation_study.json``):
GRPO, GRPO + upstream's dynamic filtering, GRPO + screening, D3S and D3S + screening + history, every arm training
the same steps, in two regimes (several passes over a few hundred prompts; one pass over fresh prompts). Per arm: the
cost to GRPO's final held-out greedy accuracy as ratios to GRPO with bootstrap intervals over seeds, the accuracy at
GRPO's wall time, the pilots' acceptance and false rejects, and what the ratios of D3S + screening read. No verdict:
a time to GRPO's final accuracy reads the evaluation grid (section 11's speed study measures speed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .stats import mean_std, p_text, thirds
from .study import first_at_least, study_analysis

READ_ARM = "D3S+screen+history"  # the arm whose ratios the reading spells out
ALPHA = 0.05
RESAMPLES = 2000  # bootstrap resamples of the seeds
COSTS = ("generated", "generation", "wall")  # cumulative per step: generated tokens, generation s, step s
REGIMES = {"passes": "several passes over {pool} prompts", "fresh": "one pass over fresh prompts"}


def generated_tokens(step):
    """The response tokens one logged step generated: every rollout (pilots, audits and filtered groups included)
    where D3S counted them, else the trained ones."""
    return step.get("d3s/generated_tokens", step["rollout/response_length_mean"] * step["rollout/num_samples"])


def _costs(run):
    """Cumulative generated response tokens, generation time and step time of one run, per step."""
    steps = run["steps"]
    return dict(
        generated=np.cumsum([generated_tokens(s) for s in steps]),
        generation=np.cumsum([s["timing/generation"] for s in steps]),
        wall=np.cumsum([s["timing/step_total"] for s in steps]),
    )


def _cost_at(costs, step, key):
    """Seed mean of a cumulative cost at ``step`` (0 at the warm start)."""
    return 0.0 if step == 0 else float(np.mean([c[key][step - 1] for c in costs]))


def _reach(curves, eval_step, target):
    """The first evaluation step at which the seed-mean curve of ``curves`` (seeds x evaluations, the warm start
    first) is at least ``target``, or None."""
    hit = first_at_least(curves.mean(axis=0), target)
    return None if hit is None else int(eval_step[hit])


def _ratios(arm, grpo, target):
    """The arm's costs to ``target`` over GRPO's, from the given seeds' arrays; inf where the arm never reached it."""
    arm_step = _reach(arm["curves"], arm["eval_step"], target)
    grpo_step = _reach(grpo["curves"], grpo["eval_step"], target)
    ratios = {}
    for key in COSTS:
        base = _cost_at(grpo["costs"], grpo_step, key) if grpo_step is not None else float("nan")
        if arm_step is None:
            ratios[key] = float("inf")
        else:
            ratios[key] = _cost_at(arm["costs"], arm_step, key) / base if base > 0 else float("nan")
    return arm_step, ratios


def _take(arm, seeds):
    costs = [arm["costs"][i] for i in seeds]
    return dict(curves=arm["curves"][seeds], eval_step=arm["eval_step"], costs=costs, final=arm["final"][seeds])


def final_target(grpo):
    """GRPO's final held-out greedy accuracy, the seed mean (the issue's target)."""
    return float(grpo["final"].mean())


def peak_target(grpo):
    """The peak of GRPO's seed-mean held-out greedy curve after the warm start: the target where GRPO's final
    accuracy is below its best (it degraded late)."""
    return float(grpo["curves"][:, 1:].mean(axis=0).max())


TARGETS = {"final": final_target, "peak": peak_target}


def bootstrap(arm, grpo, rng, target_of=final_target, resamples=RESAMPLES):
    """95% percentile intervals of the cost ratios, resampling the arm's and GRPO's seeds independently (GRPO's
    target moves with its resample). A resample that never reaches it counts as inf."""
    draws = {key: [] for key in COSTS}
    n_arm, n_grpo = len(arm["costs"]), len(grpo["costs"])
    for _ in range(resamples):
        arm_seeds, grpo_seeds = rng.integers(0, n_arm, n_arm), rng.integers(0, n_grpo, n_grpo)
        grpo_sample = _take(grpo, grpo_seeds)
        _, ratios = _ratios(_take(arm, arm_seeds), grpo_sample, target_of(grpo_sample))
        for key in COSTS:
            draws[key].append(ratios[key])
    return {key: _interval(draws[key]) for key in COSTS}


def _interval(draws):
    """The 2.5 and 97.5 percentiles of the finite-or-inf draws; nan where GRPO's own cost to the target was 0 (the
    warm start already had it) in every resample."""
    draws = np.asarray(draws, dtype=float)
    draws = draws[~np.isnan(draws)]
    if not len(draws):
        return float("nan"), float("nan")
    # order statistics: interpolating next to an inf draw would give inf - inf
    return tuple(float(v) for v in np.percentile(draws, [2.5, 97.5], method="inverted_cdf"))


def _upstream_passes(document, regime, run):
    """Passes over the data of an arm without fixed steps (which logs no ``d3s/passes``): whole passes over the
    pool, or one pass over fresh prompts."""
    if regime != "passes":
        return 1.0
    return len(run["steps"]) * document["prompts_per_step"] / document["pool"]


def _counts(runs, key):
    return float(sum(s.get(key, 0.0) for run in runs for s in run["steps"]))


def regime_analysis(document, regime):
    """Per arm of one regime: the study's analysis (``study_analysis``) plus the costs to GRPO's final accuracy (point
    ratios and bootstrap intervals), the accuracy at GRPO's total wall time, and the generation level's counts."""
    part = dict(document, results={regime: document["results"][regime]})
    analysis = study_analysis(part)[regime]
    info, target = analysis["info"], analysis["target"]
    raw = document["results"][regime]
    rng = np.random.default_rng(0)
    arrays = {}
    for method, m in info.items():
        runs = list(raw[method].values())
        n_eval = len(m["eval_step"])
        sft = document["sft_heldout"]["greedy"]
        greedy = [[e["greedy"] for e in run["heldout"]][: n_eval - 1] for run in runs]
        curves = np.array([np.concatenate([[sft], values]) for values in greedy])
        arrays[method] = dict(
            curves=curves, eval_step=m["eval_step"], costs=[_costs(run) for run in runs], final=curves[:, -1]
        )
        m["totals"] = {key: float(np.mean([c[key][-1] for c in arrays[method]["costs"]])) for key in COSTS}
        m["generation_share"] = m["totals"]["generation"] / m["totals"]["wall"]
        trained = _counts(runs, "rollout/num_samples")
        m["prompts_per_step"] = {
            key: _counts(runs, f"d3s/{key}") / sum(len(run["steps"]) for run in runs)
            for key in ("pilots", "screened_prompts", "skipped_prompts")
        }
        pilots, screened = _counts(runs, "d3s/pilots"), _counts(runs, "d3s/screened_prompts")
        audited = _counts(runs, "d3s/audited_prompts")
        m["acceptance"] = (pilots - screened) / pilots if pilots else None
        m["false_reject"] = (_counts(runs, "d3s/false_rejects") / audited, int(audited)) if audited else None
        m["trained_rollouts"] = trained / len(runs)
        m["passes"] = max(run["steps"][-1].get("d3s/passes", _upstream_passes(document, regime, run)) for run in runs)
        m["zero_var_thirds"] = thirds(np.mean([r["zero_var"] for r in m["runs"]], axis=0))
    grpo = arrays["GRPO"]
    budget = info["GRPO"]["totals"]["wall"]
    for method, m in info.items():
        m["reach"] = {}
        for name, target_of in TARGETS.items():
            step, ratios = _ratios(arrays[method], grpo, target_of(grpo))
            intervals = bootstrap(arrays[method], grpo, rng, target_of)
            m["reach"][name] = dict(step=step, ratios=ratios, intervals=intervals)
        m["reach_step"], m["ratios"], m["intervals"] = (
            m["reach"]["final"][key] for key in ("step", "ratios", "intervals")
        )
        walls = [_cost_at(arrays[method]["costs"], int(step), "wall") for step in m["eval_step"]]
        m["at_grpo_wall"] = float(m["curve"][max(i for i, wall in enumerate(walls) if wall <= budget + 1e-9)])
    info["GRPO"]["peak_target"] = peak_target(grpo)
    return target, info


def _ratio_text(ratio, interval):
    if np.isnan(ratio):
        return "- (the warm start had it)"
    if not np.isfinite(ratio):
        return "never"
    high = "never" if not np.isfinite(interval[1]) else f"{interval[1]:.2f}"
    return f"{ratio:.2f}x [{interval[0]:.2f}, {high}]"


def reading(info, regime, pilot, eval_every):
    """What D3S + screening's ratios in one regime read, in words, with what its step cost (``pilot``: the rollouts
    of a pilot). No verdict: GRPO reaches its own final accuracy at its last evaluation by construction, so an arm that
    has it at its first one (step ``eval_every``) gets that evaluation's share of the run whatever its speed; the
    sentence says so. Where GRPO's final accuracy is no better than the warm start (it degraded in training, so every
    arm has it at step 0), the target is the peak of GRPO's curve instead, and the sentence says that too."""
    m, grpo = info[READ_ARM], info["GRPO"]
    final, base = float(np.mean(m["final_greedy"])), float(np.mean(grpo["final_greedy"]))
    p = m["test_vs_grpo"][1]
    worse = final < base and not np.isnan(p) and p < ALPHA
    why = (
        f"generation is {m['generation_share']:.0%} of its step (GRPO's {grpo['generation_share']:.0%}); "
        f"{m['prompts_per_step']['screened_prompts']:.1f} of its {m['prompts_per_step']['pilots']:.1f} pilots a step "
        f"were screened out, each {pilot} rollouts generated for no training"
    )
    target, label = base, "final"
    if np.isnan(m["reach"]["final"]["ratios"]["generated"]):
        target, label = grpo["peak_target"], "peak"
    reach = m["reach"][label]
    tokens, wall = reach["ratios"]["generated"], reach["ratios"]["wall"]
    degraded = (
        ""
        if label == "final"
        else f" GRPO's final accuracy ({base:.3f}) is no better than the warm start's: it degraded in training, so "
        f"the target is the peak of its seed-mean curve ({target:.3f})."
    )
    if not np.isfinite(tokens):
        return (
            f"**Reading** ({regime}):{degraded} D3S + screening's seed-mean held-out greedy curve never reached GRPO's "
            f"{label} accuracy ({target:.3f}; its peak {float(np.max(m['curve'][1:])):.3f}, its final {final:.3f}, "
            f"p = {p_text(m['test_vs_grpo'])}). Over the run it generated "
            f"{m['totals']['generated'] / grpo['totals']['generated']:.2f}x GRPO's tokens in "
            f"{m['totals']['wall'] / grpo['totals']['wall']:.2f}x its wall time; {why}."
        )
    grid = (
        ", its first evaluation: the ratios read that evaluation's share of the run, not a speed"
        if reach["step"] == eval_every
        else ""
    )
    return (
        f"**Reading** ({regime}):{degraded} D3S + screening reached GRPO's {label} held-out greedy accuracy "
        f"({target:.3f}) at step {reach['step']}{grid}, with {tokens:.2f}x GRPO's generated tokens and {wall:.2f}x its "
        f"wall time; final accuracy {final:.3f} against GRPO's {base:.3f} (p = {p_text(m['test_vs_grpo'])}"
        f"{', significantly worse' if worse else ''}); {why}."
    )


def regime_lines(document, regime, heading):
    target, info = regime_analysis(document, regime)
    grpo = info["GRPO"]
    title = REGIMES[regime].format(pool=document.get("pool"))
    lines = [
        f"{heading} {title.capitalize()}",
        "",
        f"GRPO's final held-out greedy accuracy (seed mean): {target:.3f}; its wall time "
        f"{grpo['totals']['wall']:.0f} s of steps. Costs to GRPO's final accuracy as ratios to GRPO's, with 95% "
        "bootstrap intervals over seeds:",
        "",
        "| method | final greedy | peak greedy | p vs GRPO | greedy at GRPO's wall time | reached at step | generated "
        "tokens | generation time | wall time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in info.items():
        reach = "never" if m["reach_step"] is None else str(m["reach_step"])
        ratios = [_ratio_text(m["ratios"][key], m["intervals"][key]) for key in COSTS]
        lines.append(
            f"| {method} | {mean_std(m['final_greedy'])} | {mean_std(m['peak_greedy'])} | {p_text(m['test_vs_grpo'])} "
            f"| {m['at_grpo_wall']:.3f} | {reach} | {' | '.join(ratios)} |"
        )
    lines += [
        "",
        f"To the peak of GRPO's seed-mean curve ({grpo['peak_target']:.3f}), a target that does not fall with GRPO's "
        "last evaluations; an arm already at it at the first evaluation (GRPO included) gets that evaluation's share "
        "of the run whatever its speed:",
        "",
        "| method | reached at step | generated tokens | generation time | wall time |",
        "|---|---|---|---|---|",
    ]
    for method, m in info.items():
        peak = m["reach"]["peak"]
        reach = "never" if peak["step"] is None else str(peak["step"])
        ratios = [_ratio_text(peak["ratios"][key], peak["intervals"][key]) for key in COSTS]
        lines.append(f"| {method} | {reach} | {' | '.join(ratios)} |")
    lines += [
        "",
        "Over the whole run (seed means; pilots, screened and skipped prompts per step; the false rejects are "
        "screened-out prompts whose audited full group had variance):",
        "",
        "| method | generated tokens | generation s | wall s | generation share | pilots | screened | skipped | pilot "
        "acceptance | false rejects (audited) | passes | zero-variance groups trained (thirds) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in info.items():
        per_step = m["prompts_per_step"]
        acceptance = "-" if m["acceptance"] is None else f"{m['acceptance']:.2f}"
        rejects = "-" if m["false_reject"] is None else f"{m['false_reject'][0]:.2f} ({m['false_reject'][1]})"
        zero = " / ".join(f"{v:.2f}" for v in m["zero_var_thirds"])
        lines.append(
            f"| {method} | {m['totals']['generated']:,.0f} | {m['totals']['generation']:.0f} | "
            f"{m['totals']['wall']:.0f} | {m['generation_share']:.0%} | {per_step['pilots']:.1f} | "
            f"{per_step['screened_prompts']:.1f} | {per_step['skipped_prompts']:.1f} | {acceptance} | {rejects} | "
            f"{m['passes']:.0f} | {zero} |"
        )
    if READ_ARM not in info:  # a study still running
        return lines
    return lines + ["", reading(info, regime, document.get("pilot", "k"), document["eval_every"])]


def generation_body(document, heading="###"):
    results = document["results"]
    runs = [run for regime in results.values() for arm in regime.values() for run in arm.values()]
    dates = sorted({run["date"] for run in runs})
    minutes = sum(run["process_seconds"] + run["eval_seconds"] for run in runs) / 60
    seeds = len(next(iter(next(iter(results.values())).values())))
    lines = [
        f"Command: `.venv/bin/python benchmarks/bench_learning.py --parts screen --seeds "
        f"{' '.join(map(str, range(seeds)))} --out benchmarks/results` ({', '.join(dates)}; {document['machine']}; "
        f"{minutes:.0f} minutes of runs and evaluations"
        f"{', plus the SFT warm start' if 'sft_seconds' in document else ''}). Task `{document['task']}`: every arm "
        f"trains {document['steps']} steps of {document['prompts_per_step']} prompts x G = 16 rollouts, {seeds} seeds, "
        f"held-out greedy accuracy every {document['eval_every']} steps (the SFT start: "
        f"{document['sft_heldout']['greedy']:.3f}). Screening pilots k = {document.get('pilot')} rollouts and "
        f"completes {document.get('audit', 0):.0%} of the screened-out prompts to count false rejects (their tokens "
        "and time are in its costs). GRPO + DF is upstream's `--algo.dynamic_filtering_enable` (flat groups dropped "
        "after all G rollouts, replaced), at the same fixed steps.",
        "",
        "**What this study cannot say.** Every arm ran at one learning rate, and each ratio is the time to GRPO's "
        "final accuracy: GRPO reaches it at its last evaluation by construction, and an arm above it at the first "
        f"evaluation (step {document['eval_every']}) gets that evaluation's share of the run whatever its speed. "
        "Its ratios read GRPO's runs at that rate and the evaluation grid, not how much sooner an arm reaches an "
        "accuracy, and it gives no verdict. The speed study "
        "(`benchmarks/bench_speed.py`, section 11) measures that.",
    ]
    for regime in (r for r in REGIMES if r in results):
        lines += ["", *regime_lines(document, regime, heading)]
    if document.get("quick"):
        lines += ["", "This is a smoke test (`--quick`): too few steps for any conclusion."]
    return lines


def generation_section(path, number):
    """The RESULTS.md section of ``generation_study.json``."""
    document = json.loads(Path(path).read_text())
    title = (
        f"## {number}. The generation level's first study, at one rate and fixed steps: screening, skipping, filtering"
    )
    return [title, "", *generation_body(document)]


def generation_main(path, output):
    """The study alone, written to ``output``; returns ``output``."""
    document = json.loads(Path(path).read_text())
    lines = [f"# The generation level at fixed steps on `{document['task']}`", "", *generation_body(document, "##")]
    Path(output).write_text("\n".join(lines) + "\n")
    print(f"wrote {output}")
    return output
