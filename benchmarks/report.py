"""Turn the benchmark results into ``benchmarks/RESULTS.md`` with its plots (``benchmarks/results/*.png``).

    .venv/bin/python benchmarks/report.py [--results benchmarks/results]

Reads ``selection.json`` (bench_selection.py), ``step_cost.json`` (bench_step_cost.py) and ``learning.json``
(the earlier addition-task learning runs). ``--study learning_study.json --output STUDY.md`` instead writes the
report of ``bench_learning.py``'s study (tables, Welch tests, ``STUDY.png``). Every number and every comparison in the document is computed here from those files, so
a rerun of ``benchmarks/run_all.sh`` regenerates the whole document consistently.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SMOOTH = 10  # steps of the trailing mean used for "reward reached" and for the final reward
GAIN_FRACTIONS = (0.5, 0.75, 0.9, 1.0)  # of GRPO's reward gain over the run
PAPER_SPEEDUP = {"D3S": 2.04, "PODS": 1.7}  # D3S: 2.04x faster than GRPO; PODS: >= 1.7x sooner to GRPO's peak
COLORS = {"GRPO": "tab:gray", "PODS": "tab:orange", "D3S": "tab:blue", "D3S-I": "tab:green"}


def trailing_mean(values, window=SMOOTH):
    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


# -- learning efficiency ------------------------------------------------------------------------------------------


def seed_curves(run):
    """Per step: reward, training wall clock (cumulative), cumulative policy-gradient tokens, grad norm."""
    steps = run["steps"]
    reward = np.array([s["rollout/reward_mean"] for s in steps])
    wall = np.cumsum([s["timing/step_total"] for s in steps])
    tokens = np.cumsum(
        [
            s["d3s/kept_tokens"]
            if "d3s/kept_tokens" in s
            else s["rollout/response_length_mean"] * s["rollout/num_samples"]
            for s in steps
        ]
    )
    grad = np.array([s["actor_grad_norm"] for s in steps])
    kept = np.array([s.get("d3s/kept_rollouts", s["rollout/num_samples"]) for s in steps])
    select = np.array([s.get("d3s/select_time_s", 0.0) for s in steps])
    step_total = np.array([s["timing/step_total"] for s in steps])
    untrained = np.array([s["timing/generation"] + s["timing/broadcast"] for s in steps])  # not touched by D3S
    return dict(
        reward=reward, wall=wall, tokens=tokens, grad=grad, kept=kept, select=select, step_total=step_total,
        untrained=untrained,
    )  # fmt: skip


def first_reach(smoothed, target):
    # the tolerance lets GRPO's own curve reach its final value (its last trailing mean is that value)
    hits = np.nonzero(smoothed >= target - 1e-9)[0]
    return int(hits[0]) if len(hits) else None


def learning_analysis(document):
    methods = {}
    for method, seeds in document["results"].items():
        curves = [seed_curves(run) for run in seeds.values()]
        mean = {key: np.mean([c[key] for c in curves], axis=0) for key in curves[0]}
        methods[method] = {
            "curves": curves,
            "mean": mean,
            "heldout_greedy": [run["heldout"]["greedy"] for run in seeds.values()],
            "heldout_sampled": [run["heldout"]["sampled"] for run in seeds.values()],
            "final": [float(c["reward"][-SMOOTH:].mean()) for c in curves],
            "seeds": list(seeds),
        }
    target = float(np.mean(methods["GRPO"]["final"]))
    for info in methods.values():
        mean = info["mean"]
        index = first_reach(trailing_mean(mean["reward"]), target)
        info["reach_step"] = None if index is None else index + 1
        info["reach_wall"] = None if index is None else float(mean["wall"][index])
        info["reach_tokens"] = None if index is None else float(mean["tokens"][index])
        per_seed = []
        for curve in info["curves"]:
            hit = first_reach(trailing_mean(curve["reward"]), target)
            per_seed.append(None if hit is None else float(curve["wall"][hit]))
        info["reach_wall_per_seed"] = per_seed
    # the same SFT model samples step 1 of every run: the common starting reward
    start = float(np.mean([info["mean"]["reward"][0] for info in methods.values()]))
    for info in methods.values():
        smoothed = trailing_mean(info["mean"]["reward"])
        info["gain_reach"] = {}
        for fraction in GAIN_FRACTIONS:
            hit = first_reach(smoothed, start + fraction * (target - start))
            info["gain_reach"][fraction] = None if hit is None else (hit + 1, float(info["mean"]["wall"][hit]))
    grpo = methods["GRPO"]
    for info in methods.values():
        info["speedup_wall"] = _ratio(grpo["reach_wall"], info["reach_wall"])
        info["speedup_steps"] = _ratio(grpo["reach_step"], info["reach_step"])
        info["speedup_tokens"] = _ratio(grpo["reach_tokens"], info["reach_tokens"])
    return target, start, methods


def _ratio(numerator, denominator):
    return None if numerator is None or denominator is None else numerator / denominator


def plot_learning(methods, target, path_reward, path_grad):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for method, info in methods.items():
        mean = info["mean"]
        smoothed = np.array([trailing_mean(c["reward"]) for c in info["curves"]])
        low, high = smoothed.min(axis=0), smoothed.max(axis=0)
        for axis, x in zip(axes, (np.arange(1, len(mean["reward"]) + 1), mean["wall"], mean["tokens"] / 1e3)):
            axis.plot(x, trailing_mean(mean["reward"]), color=COLORS.get(method), label=method)
            axis.fill_between(x, low, high, color=COLORS.get(method), alpha=0.12)
    for axis, label in zip(axes, ("RL step", "training wall clock (s, sum of step times)", "policy-gradient tokens (k)")):
        axis.axhline(target, color="black", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel(f"rollout reward ({SMOOTH}-step trailing mean)")
    axes[0].legend(loc="lower right", fontsize=9)
    axes[1].set_title("seed mean (line) and seed range (band); dotted: GRPO's final reward")
    figure.tight_layout()
    figure.savefig(path_reward, dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(7, 4))
    for method, info in methods.items():
        grad = info["mean"]["grad"]
        axis.plot(np.arange(1, len(grad) + 1), trailing_mean(grad, 5), color=COLORS.get(method), label=method)
    axis.set_xlabel("RL step")
    axis.set_ylabel("actor grad norm (last optimizer step; 5-step mean)")
    axis.legend(fontsize=9)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path_grad, dpi=110)
    plt.close(figure)


# -- step cost ----------------------------------------------------------------------------------------------------


def plot_step_cost(points, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = points[0]
    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    axis.plot([0, 1.05], [0, 1.05], color="black", linestyle=":", linewidth=1, label="time ratio = kept-rollout ratio")
    for key, marker, color, label in (
        ("timing/make_experience", "o", "tab:blue", "experience making"),
        ("timing/ppo_train", "s", "tab:red", "actor update"),
        ("timing/step_total", "^", "tab:gray", "whole step (incl. generation)"),
    ):
        for point in points[1:]:
            axis.scatter(
                point["kept_rollouts"] / base["kept_rollouts"],
                point[key] / base[key],
                marker=marker,
                s=60,
                facecolors=color if point["k"] >= 1.0 else "none",
                edgecolors=color,
                label=label if point is points[1] else None,
            )
    axis.set_xlabel("kept rollouts / all rollouts")
    axis.set_ylabel("time / GRPO's time (median step)")
    axis.set_xlim(0, 1.05)
    axis.set_ylim(0, 1.3)
    axis.set_title("D3S step cost vs GRPO (filled: K = 1, open: K = 0.2)")
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- the document -------------------------------------------------------------------------------------------------


def fmt(value, pattern="{:.2f}", missing="not reached"):
    return missing if value is None else pattern.format(value)


def mean_std(values, pattern="{:.3f}"):
    return f"{pattern.format(statistics.mean(values))} ± {pattern.format(statistics.stdev(values) if len(values) > 1 else 0.0)}"


def step_cost_section(cost):
    points = cost["points"]
    base = points[0]
    rows = [
        "| point | kept rollouts | PG tokens | experience making | actor update | generation | whole step | "
        "selection |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in points:
        kept = point["kept_rollouts"] / base["kept_rollouts"]
        tokens = point["pg_tokens"] / base["pg_tokens"]
        cells = [
            point["label"],
            f"{point['kept_rollouts']:.0f} ({kept:.2f})",
            f"{point['pg_tokens']:.0f} ({tokens:.2f})",
            f"{point['timing/make_experience']:.2f} s ({point['timing/make_experience'] / base['timing/make_experience']:.2f})",
            f"{point['timing/ppo_train']:.2f} s ({point['timing/ppo_train'] / base['timing/ppo_train']:.2f})",
            f"{point['timing/generation']:.2f} s",
            f"{point['timing/step_total']:.2f} s ({point['timing/step_total'] / base['timing/step_total']:.2f})",
            f"{point['select_time_s'] * 1e3:.1f} ms",
        ]
        rows.append("| " + " | ".join(cells) + " |")

    def ratio(point, key):
        return point[key] / base[key]

    by_label = {p["label"]: p for p in points}
    token_only = by_label.get("N/G=1, K=0.2")
    sample_points = [p for p in points[1:] if p["n"] < cost["group"]]
    kept_fracs = [p["kept_rollouts"] / base["kept_rollouts"] for p in sample_points]
    make_ratios = [ratio(p, "timing/make_experience") for p in sample_points]
    train_ratios = [ratio(p, "timing/ppo_train") for p in sample_points]
    excess = [made - kept for made, kept in zip(make_ratios, kept_fracs)]

    def listing(values):
        return ", ".join(f"{v:.2f}" for v in values)

    lines = [
        "## 1. Step cost: experience making and actor update",
        "",
        f"Command: `.venv/bin/python {cost['command']}` · machine: {cost['machine']} · date: {cost['date']}.",
        "",
        f"Each row is a real `train_ppo_ray` run on the CPU runtime: a randomly initialised Llama "
        f"({cost['model']['shape']['num_layers']} layers, hidden {cost['model']['shape']['hidden_size']}, vocabulary "
        f"{cost['model']['vocab']}), {cost['prompts_per_step']} prompts x {cost['group']} rollouts of "
        f"{base['response_length_mean']:.0f} tokens per step, reference model on (KL coefficient 0.001), learning "
        "rate 0 so that every step of every run samples from the same policy. D3S rows use cross-group selection "
        "at a constant (N, K). Times are medians over steps 2-5 (step 1 is warm-up); ratios to GRPO in "
        "parentheses. \"Experience making\" is OpenRLHF's `timing/make_experience` (reward, selection, actor "
        "log-prob + entropy and reference forwards); \"actor update\" is `timing/ppo_train` (forward, backward, "
        "optimizer steps).",
        "",
        *rows,
        "",
        "![step cost](results/step_cost.png)",
        "",
        "**Reading.**",
        f"- Experience making at kept fractions {listing(kept_fracs)} took {listing(make_ratios)} of GRPO's time: "
        + (
            "it scales with the kept rollouts, because selection runs before the log-prob forwards. "
            if abs(statistics.mean(excess)) <= 0.15
            else "it does not scale in proportion to the kept rollouts. "
        )
        + f"The excess over the kept fraction (mean {statistics.mean(excess):+.2f}) is per-step work that does not "
        "shrink with selection: reward and advantage bookkeeping, Ray transfers of all rollouts, the selection.",
        f"- The actor update took {listing(train_ratios)} of GRPO's time for the same points"
        + (
            ": it scales with the kept rollouts (fewer micro-batches and optimizer steps)."
            if abs(statistics.mean(t - k for t, k in zip(train_ratios, kept_fracs))) <= 0.15
            else ", not in proportion to the kept rollouts."
        ),
    ]
    if token_only is not None:
        unchanged = all(abs(ratio(token_only, key) - 1) <= 0.1 for key in ("timing/make_experience", "timing/ppo_train"))
        lines.append(
            f"- Token selection alone (N = G, K = 0.2: {token_only['pg_tokens'] / base['pg_tokens']:.2f} of the "
            f"policy-gradient tokens) took {ratio(token_only, 'timing/make_experience'):.2f} (experience making) and "
            f"{ratio(token_only, 'timing/ppo_train'):.2f} (update) of GRPO's time"
            + (": it saves no forward or backward compute, as expected." if unchanged else ".")
            + " The masked tokens still pass through the model (the KL term and GSPO's sequence ratio "
            "need their log-probs); what the mask changes is which tokens carry gradient signal, i.e. the "
            "learning signal per step (section 2), not the cost of a step. Its own cost is the entropy over the "
            "vocabulary in the experience-making forward, included in the figure above."
        )
    lines.append(
        f"- Generation is untouched by D3S ({statistics.mean(p['timing/generation'] for p in points):.1f} s per step "
        "here at every point): the whole step shrinks less than its trained parts."
    )
    return lines


def selection_section(selection, cost, learning_methods):
    rows = {(r["prompts"], r["group"], r["scope"]): r for r in selection["rows"]}
    big = rows.get((1024, 64, "cross"))
    step_cost_shares = [p["select_time_s"] / p["timing/step_total"] for p in cost["points"][1:]]
    learning_shares = []
    for method, info in learning_methods.items():
        if method == "GRPO":
            continue
        for curve in info["curves"]:
            learning_shares.append(float(np.median(curve["select"] / curve["step_total"])))
    lines = [
        "## 3. Selection overhead in context",
        "",
        f"Core benchmark (`.venv/bin/python benchmarks/bench_selection.py`, {selection['date']}, "
        "[RESULTS_selection.md](RESULTS_selection.md)): exact max-variance selection of B x G rollouts, torch's default threads.",
        "",
        "| B x G | intra (ms) | cross (ms) |",
        "|:---|---:|---:|",
    ]
    for prompts, group in sorted({(r["prompts"], r["group"]) for r in selection["rows"]}):
        intra, cross = rows[(prompts, group, "intra")], rows[(prompts, group, "cross")]
        lines.append(f"| {prompts} x {group} | {intra['ours_ms']:.2f} | {cross['ours_ms']:.2f} |")
    lines += [
        "",
        f"- Inside the pipeline, `d3s/select_time_s` (selection + token mask, as logged) was a median "
        f"{100 * statistics.median(step_cost_shares):.3f}% of a step in the step-cost runs (128 rollouts of 64 "
        f"tokens) and {100 * statistics.median(learning_shares):.2f}% in the learning runs (256 rollouts of <= 4 "
        "tokens, where a whole step takes well under a second).",
    ]
    if big is not None:
        lines.append(
            f"- At 1024 prompts x 64 rollouts (65,536 rollouts) cross-group selection "
            f"takes {big['ours_ms']:.1f} ms: it would reach 1% of a step only if the whole step (generation of 65k "
            f"responses, forwards, update) took under {big['ours_ms'] * 100 / 1e3:.1f} s."
        )
    return lines


def learning_section(document, target, start, methods):
    seeds = len(next(iter(methods.values()))["seeds"])
    rows = [
        "| method | final reward | held-out greedy | held-out sampled | PG tokens (total) | training time | "
        "reaches GRPO's final reward at | speed-up (time) | speed-up (steps) | speed-up (PG tokens) | "
        "seeds reaching it |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, info in methods.items():
        reached = sum(t is not None for t in info["reach_wall_per_seed"])
        mean = info["mean"]
        cells = [
            method,
            mean_std(info["final"]),
            mean_std(info["heldout_greedy"]),
            mean_std(info["heldout_sampled"]),
            f"{mean['tokens'][-1] / 1e3:.1f}k",
            f"{mean['wall'][-1]:.0f} s",
            "not reached"
            if info["reach_step"] is None
            else f"step {info['reach_step']}, {info['reach_wall']:.0f} s",
            fmt(info["speedup_wall"], "{:.2f}x", "-"),
            fmt(info["speedup_steps"], "{:.2f}x", "-"),
            fmt(info["speedup_tokens"], "{:.2f}x", "-"),
            f"{reached}/{len(info['reach_wall_per_seed'])}",
        ]
        rows.append("| " + " | ".join(cells) + " |")

    gain_rows = [
        "| method | " + " | ".join(f"{100 * f:.0f}% of GRPO's gain" for f in GAIN_FRACTIONS) + " |",
        "|:---|" + "---:|" * len(GAIN_FRACTIONS),
    ]
    for method, info in methods.items():
        cells = []
        for fraction in GAIN_FRACTIONS:
            reached, base = info["gain_reach"][fraction], methods["GRPO"]["gain_reach"][fraction]
            if reached is None:
                cells.append("not reached")
            else:
                speedup = f", {base[1] / reached[1]:.2f}x" if base is not None and method != "GRPO" else ""
                cells.append(f"step {reached[0]}, {reached[1]:.0f} s{speedup}")
        gain_rows.append(f"| {method} | " + " | ".join(cells) + " |")

    parts = ("timing/generation", "timing/make_experience", "timing/ppo_train", "timing/broadcast", "timing/step_total")
    timing_rows = [
        "| method | kept rollouts | generation | experience making | actor update | weight sync | whole step |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, runs in document["results"].items():
        steps = [step for run in runs.values() for step in run["steps"]]
        kept = statistics.mean(step.get("d3s/kept_rollouts", step["rollout/num_samples"]) for step in steps)
        means = [statistics.mean(step[key] for step in steps) for key in parts]
        timing_rows.append(f"| {method} | {kept:.0f} | " + " | ".join(f"{value:.3f} s" for value in means) + " |")

    grad_rows = ["| method | grad norm, steps 1-25 | steps 26-50 | steps 51-75 |", "|:---|---:|---:|---:|"]
    for method, info in methods.items():
        grad = info["mean"]["grad"]
        thirds = np.array_split(grad, 3)
        grad_rows.append(f"| {method} | " + " | ".join(f"{part.mean():.2f}" for part in thirds) + " |")

    grpo_grad = methods["GRPO"]["mean"]["grad"].mean()
    reading = ["**Reading.**"]
    for method in ("D3S", "D3S-I", "PODS"):
        if method not in methods:
            continue
        info = methods[method]
        paper = PAPER_SPEEDUP.get(method)
        speedup = info["speedup_wall"]
        if speedup is None:
            verdict = "never reached GRPO's final reward (seed-mean curve)"
        else:
            verdict = (
                f"reached GRPO's final reward {speedup:.2f}x as fast in training time ({info['speedup_steps']:.2f}x "
                f"in steps, {info['speedup_tokens']:.2f}x in policy-gradient tokens)"
            )
        spread = info["reach_wall_per_seed"]
        spread_text = (
            " (per seed, time to reach it: " + ", ".join("-" if t is None else f"{t:.0f} s" for t in spread) + ")"
            if any(t is not None for t in spread)
            else ""
        )
        if paper is None:
            compare = ""
        elif speedup is not None and speedup >= 0.8 * paper:
            compare = f"; in line with the paper's {paper}x"
        elif speedup is not None and speedup > 1.05:
            compare = f"; faster than GRPO, but short of the paper's {paper}x"
        else:
            compare = f"; this does not reproduce the paper's {paper}x"
        shares = []
        for fraction in GAIN_FRACTIONS:
            reached, base = info["gain_reach"][fraction], methods["GRPO"]["gain_reach"][fraction]
            shares.append("-" if reached is None or base is None else f"{base[1] / reached[1]:.2f}x")
        reading.append(
            f"- {method} {verdict}{spread_text}{compare}. Time speed-up at "
            + "/".join(f"{100 * f:.0f}" for f in GAIN_FRACTIONS)
            + f"% of GRPO's gain: {' / '.join(shares)}."
        )
    def standard_error(values):
        return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")

    gaps = []
    for method, info in methods.items():
        if method == "GRPO":
            continue
        gap = float(np.mean(info["final"])) - target
        error = (standard_error(info["final"]) ** 2 + standard_error(methods["GRPO"]["final"]) ** 2) ** 0.5
        gaps.append(f"{method} {gap:+.3f} ({gap / error:+.1f} standard errors)")
    best = max(methods, key=lambda m: np.mean(methods[m]["final"]))
    reading.append(
        f"- Final reward against GRPO's {target:.3f} (mean of the last {SMOOTH} steps, {seeds} seeds): "
        f"{', '.join(gaps)}; best: {best}. Differences within about 2 standard errors are not resolved by "
        f"{seeds} seeds."
    )
    grad_ratios = {m: info["mean"]["grad"].mean() / grpo_grad for m, info in methods.items() if m != "GRPO"}
    higher = [m for m, r in grad_ratios.items() if r > 1.05]
    reading.append(
        "- Gradient norm: "
        + ", ".join(f"{m} {r:.2f}x" for m, r in grad_ratios.items())
        + " GRPO's mean over the run. "
        + (
            f"{' and '.join(higher)} raise it, as the D3S paper reports for D3S."
            if higher
            else "None raises it clearly, unlike the D3S paper's claim."
        )
        + " What is kept explains a rise: max-variance selection keeps the rollouts with the largest |advantage|, "
        "the token mask the tokens with the largest |A|*H, and the loss is a mean over the kept tokens, so each "
        "carries a larger gradient. (OpenRLHF logs the norm of a step's last optimizer step only.)"
    )
    grpo_mean = methods["GRPO"]["mean"]
    untrained_share = float(grpo_mean["untrained"].sum() / grpo_mean["step_total"].sum())
    step_means = ", ".join(f"{m} {info['mean']['step_total'].mean():.2f} s" for m, info in methods.items())
    reading.append(
        f"- Wall clock: a GRPO step here takes {grpo_mean['step_total'].mean():.2f} s, of which generation and "
        f"weight sync (untouched by D3S) are {100 * untrained_share:.0f}%; only the rest can shrink with "
        f"selection (section 1). Mean step: {step_means}. With a 2-layer model and responses of <= 4 tokens the "
        "trained part of a step is small; with long responses on GPUs it is a larger share (section 1)."
    )
    reading.append(
        "- How this setting differs from the papers': a 2-layer model from a 0.6-accurate SFT start, responses "
        "of <= 4 tokens (the token mask chooses among 1-4 tokens of a rollout), 75 steps, G = 16 and the same "
        "rollouts per step for every method. The papers measure time to accuracy on GPUs with long "
        "chain-of-thought responses; PODS's gain comes from generating more rollouts (n = 64) than it trains "
        "(m = 16), which an equal rollout budget per step does not give it here."
    )
    return [
        "## 2. Learning efficiency on the built-in task",
        "",
        f"Command: `.venv/bin/python {document['command']}` · machine: {document['machine']} · date: "
        f"{document['date']}.",
        "",
        "The demo's job (`python -m d3s_openrlhf.cli.demo`): a 2-layer Llama warm-started by SFT on integer "
        "addition (held-out greedy accuracy after SFT "
        f"{document['sft_heldout']['greedy']:.3f}), then 75 RL steps of 16 prompts x 16 rollouts, lr 2e-4. Every "
        "method generates the same number of rollouts per step (the same rollout budget) and differs only in its "
        "`--d3s.*` flags: "
        + "; ".join(
            f"{m}: `{' '.join(flags) if flags else 'D3S off'}`" for m, flags in document["methods"].items()
        )
        + f". {seeds} seeds each (`--train.seed`). Reward is the exact-match reward of all generated rollouts "
        f"(temperature 1); \"final\" is the mean of the last {SMOOTH} steps; training time is the sum of "
        "OpenRLHF's per-step `timing/step_total` (generation + experience making + update + weight sync; Ray and "
        "vLLM start-up excluded, equal for all). A method reaches GRPO's final reward at the first step where its "
        f"seed-mean reward, as a {SMOOTH}-step trailing mean, is at least GRPO's final reward; speed-up = GRPO's "
        "time (steps, tokens) to get there / the method's.",
        "",
        *rows,
        "",
        f"Time (seed-mean curve, {SMOOTH}-step trailing mean) to reach a share of GRPO's gain from the common "
        f"starting reward {start:.3f} (step 1 samples the SFT model) to its final reward {target:.3f}; speed-up "
        "against GRPO's time for the same share:",
        "",
        *gain_rows,
        "",
        "![reward](results/learning_reward.png)",
        "",
        "Mean per step over all steps and seeds (OpenRLHF's timings):",
        "",
        *timing_rows,
        "",
        *grad_rows,
        "",
        "![grad norm](results/learning_grad_norm.png)",
        "",
        *reading,
    ]


def summary(cost, target, methods):
    """The headline numbers of the three sections."""
    base = cost["points"][0]
    smallest = min(cost["points"][1:], key=lambda p: (p["kept_rollouts"], p["k"]))
    lines = [
        "**Summary.**",
        f"- Step cost ({smallest['label']}, section 1): experience making "
        f"{smallest['timing/make_experience'] / base['timing/make_experience']:.2f}, actor update "
        f"{smallest['timing/ppo_train'] / base['timing/ppo_train']:.2f}, whole step "
        f"{smallest['timing/step_total'] / base['timing/step_total']:.2f} of GRPO's time for "
        f"{smallest['kept_rollouts'] / base['kept_rollouts']:.2f} of its rollouts.",
    ]
    grpo_tokens = methods["GRPO"]["mean"]["tokens"][-1]
    for method, info in methods.items():
        if method == "GRPO":
            continue
        final = float(np.mean(info["final"]))
        reached = "reached" if info["reach_wall"] is not None else "did not reach"
        lines.append(
            f"- {method} (section 2): {reached} GRPO's final reward {target:.3f} in 75 steps (final {final:.3f}), "
            f"with {info['mean']['tokens'][-1] / grpo_tokens:.2f} of GRPO's policy-gradient tokens and "
            f"{info['mean']['grad'].mean() / methods['GRPO']['mean']['grad'].mean():.2f}x its gradient norm."
        )
    shares = [p["select_time_s"] / p["timing/step_total"] for p in cost["points"][1:]]
    lines.append(f"- Selection (section 3): at most {100 * max(shares):.2f}% of a step in the step-cost runs.")
    return lines


# -- the study (bench_learning.py: learning_study.json) ------------------------------------------------------------

STUDY_COLORS = {
    "GRPO": "tab:gray", "PODS": "tab:orange", "PODS-random": "tab:brown", "PODS-max-reward": "tab:pink",
    "D1S": "tab:purple", "D1S-Cross": "tab:olive", "D2S": "tab:cyan", "D3S": "tab:blue", "D3S-I": "tab:green",
}  # fmt: skip


def welch_t_test(a, b):
    """Two-sided Welch t-test of mean(a) != mean(b): ``(t, p)``; p from the Student t density integrated
    numerically (no SciPy here). ``(nan, nan)`` when a sample has fewer than 2 values or both have no spread."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return float("nan"), float("nan")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return float("nan"), float("nan")
    t = (a.mean() - b.mean()) / np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    x = np.linspace(0.0, abs(t), 20001)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_norm - (df + 1) / 2 * np.log1p(x**2 / df))
    inner = float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(x)))  # P(0 < T < |t|)
    return float(t), float(max(0.0, 1.0 - 2.0 * inner))


def study_run(run, prompts):
    """Per step of one run: cumulative trained tokens, wall time and generation time, zero-variance share, grad
    norm; the held-out curve as arrays."""
    steps = run["steps"]
    tokens = np.cumsum(
        [s.get("d3s/kept_tokens", s["rollout/response_length_mean"] * s["rollout/num_samples"]) for s in steps]
    )
    return dict(
        tokens=tokens,
        wall=np.cumsum([s["timing/step_total"] for s in steps]),
        generation=np.cumsum([s["timing/generation"] for s in steps]),
        zero_var=np.array([s.get("d3s/zero_var_groups", np.nan) / prompts for s in steps]),
        grad=np.array([s["actor_grad_norm"] for s in steps]),
        eval_step=np.array([e["step"] for e in run["heldout"]]),
        greedy=np.array([e["greedy"] for e in run["heldout"]]),
        sampled=np.array([e["sampled"] for e in run["heldout"]]),
        entropy=np.array([e["entropy"] for e in run["heldout"]]),
    )


def thirds(values):
    return [float(np.nanmean(chunk)) for chunk in np.array_split(np.asarray(values, dtype=float), 3)]


def study_analysis(document):
    """Per part and method: seed lists of final/peak accuracy, time to GRPO's final held-out greedy accuracy
    (seed-mean curve) in steps, trained tokens and wall time, and the training-dynamics summaries."""
    prompts = document["prompts_per_step"]
    sft = document["sft_heldout"]
    parts = {}
    for part, methods in document["results"].items():
        info = {}
        for method, seeds in methods.items():
            runs = [study_run(run, prompts) for run in seeds.values()]
            n_eval = min(len(r["eval_step"]) for r in runs)
            curve = np.mean([np.concatenate([[sft["greedy"]], r["greedy"][:n_eval]]) for r in runs], axis=0)
            info[method] = dict(
                runs=runs,
                seeds=list(seeds),
                group=next(iter(seeds.values()))["group"],
                eval_step=np.concatenate([[0], runs[0]["eval_step"][:n_eval]]),
                curve=curve,
                final_greedy=[float(r["greedy"][-1]) for r in runs],
                final_sampled=[float(r["sampled"][-1]) for r in runs],
                peak_greedy=[float(r["greedy"].max()) for r in runs],
                final_entropy=[float(r["entropy"][-1]) for r in runs],
            )
        if "GRPO" not in info:
            parts[part] = (None, info)
            continue
        target = float(np.mean(info["GRPO"]["final_greedy"]))
        for method, m in info.items():
            hits = np.nonzero(m["curve"] >= target - 1e-9)[0]
            step = int(m["eval_step"][hits[0]]) if len(hits) else None
            m["reach_step"] = step
            if step is None:
                m["reach_tokens"] = m["reach_wall"] = m["reach_generation_share"] = None
            elif step == 0:
                m["reach_tokens"] = m["reach_wall"] = 0.0
                m["reach_generation_share"] = None
            else:
                m["reach_tokens"] = float(np.mean([r["tokens"][step - 1] for r in m["runs"]]))
                m["reach_wall"] = float(np.mean([r["wall"][step - 1] for r in m["runs"]]))
                m["reach_generation_share"] = float(
                    np.mean([r["generation"][step - 1] for r in m["runs"]]) / m["reach_wall"]
                )
            m["test_vs_grpo"] = welch_t_test(m["final_greedy"], info["GRPO"]["final_greedy"])
        parts[part] = (target, info)
    return parts


def plot_study(parts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(parts), 3, figsize=(15, 4 * len(parts)), squeeze=False)
    for row, (part, (target, info)) in zip(axes, parts.items()):
        for method, m in info.items():
            color = STUDY_COLORS.get(method)
            finals = np.array([np.concatenate([[m["curve"][0]], r["greedy"][: len(m["curve"]) - 1]]) for r in m["runs"]])
            row[0].plot(m["eval_step"], m["curve"], "o-", color=color, label=method)
            row[0].fill_between(m["eval_step"], finals.min(0), finals.max(0), color=color, alpha=0.12)
            steps = np.arange(1, len(m["runs"][0]["zero_var"]) + 1)
            row[1].plot(steps, trailing_mean(np.nanmean([r["zero_var"] for r in m["runs"]], axis=0)), color=color)
            row[2].plot(steps, trailing_mean(np.mean([r["grad"] for r in m["runs"]], axis=0)), color=color)
        if target is not None:
            row[0].axhline(target, color="black", linestyle=":", linewidth=1)
        row[0].set_ylabel(f"{part}: held-out greedy accuracy")
        row[1].set_ylabel("share of zero-variance groups")
        row[2].set_ylabel("actor grad norm")
        for axis in row:
            axis.set_xlabel("RL step")
            axis.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def study_document(document, parts, plot_name):
    lines = [
        f"# Learning-efficiency study on `{document['task']}`",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_learning.py --task {document['task']}` (see its docstring) · "
        f"machine: {document['machine']} · {document['prompts_per_step']} prompts per step · held-out evaluation "
        f"every {document['eval_every']} steps ({document['eval_samples']} samples per prompt at T = 1). "
        f"SFT warm start: held-out greedy {document['sft_heldout']['greedy']:.3f}, sampled "
        f"{document['sft_heldout']['sampled']:.3f}.",
        "",
        "Accuracies are mean ± standard deviation over seeds. \"Reaches GRPO\" is the first evaluation at which the "
        "seed-mean held-out greedy accuracy is at least GRPO's final one (the part's dotted line), with the trained "
        "(policy-gradient) tokens and the summed step time (`timing/step_total`) up to that step, and the share of "
        "that time spent generating. p: two-sided Welch t-test of the final greedy accuracy against GRPO's "
        "(3 seeds give the test little power: a large p is no evidence of equality).",
        "",
    ]
    for part, (target, info) in parts.items():
        lines += [
            f"## Part `{part}`" + ("" if target is None else f" (GRPO's final held-out greedy accuracy {target:.3f})"),
            "",
            "| method | G | seeds | final greedy | final sampled | peak greedy | reaches GRPO at step | trained tokens "
            "| wall time (generation share) | p vs GRPO | zero-var groups, thirds | grad norm, thirds | entropy, final |",
            "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for method, m in info.items():
            zero = thirds(np.nanmean([r["zero_var"] for r in m["runs"]], axis=0))
            grad = thirds(np.mean([r["grad"] for r in m["runs"]], axis=0))
            reach = "not reached" if m.get("reach_step") is None else str(m["reach_step"])
            share = m.get("reach_generation_share")
            wall = "-" if m.get("reach_wall") is None else (
                f"{m['reach_wall']:.0f} s" + ("" if share is None else f" ({100 * share:.0f}%)")
            )  # fmt: skip
            tokens = "-" if m.get("reach_tokens") is None else f"{m['reach_tokens'] / 1e3:.1f}k"
            t, p = m.get("test_vs_grpo", (float("nan"), float("nan")))
            lines.append(
                f"| {method} | {m['group']} | {len(m['seeds'])} | {mean_std(m['final_greedy'])} | "
                f"{mean_std(m['final_sampled'])} | {mean_std(m['peak_greedy'])} | {reach} | {tokens} | {wall} | "
                f"{'-' if method == 'GRPO' or math.isnan(p) else f'{p:.2f}'} | "
                f"{' / '.join(f'{z:.2f}' for z in zero)} | {' / '.join(f'{g:.2f}' for g in grad)} | "
                f"{mean_std(m['final_entropy'], '{:.2f}')} |"
            )
        lines.append("")
    lines += [f"![study]({plot_name})", ""]
    return lines


def study_main(path, output):
    document = json.loads(Path(path).read_text())
    parts = study_analysis(document)
    plot_path = Path(output).with_suffix(".png")
    plot_study(parts, plot_path)
    Path(output).write_text("\n".join(study_document(document, parts, plot_path.name)))
    print(f"wrote {output} and {plot_path}")
    return output


def memory_section(memory):
    """Peak extra memory of the log-prob / entropy forwards (bench_memory.py)."""
    lines = [
        "## 4. Memory of the log-prob and entropy forward",
        "",
        f"Command: `PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py` ({memory['date']}, "
        f"{memory['machine']}). Peak extra memory from torch's CPU allocator events (exact, not RSS), in MiB: one "
        f"sequence of T tokens, A = T/2 action tokens, hidden size {memory['hidden']}, vocabulary {memory['vocab']:,}, "
        f"fp32 weights. Upstream's log-prob forward holds about twice the fp32 logits; D3S's entropy of the action "
        "positions reads those logits in place (views, never a copy of the `logits[:, :-1][:, -A:]` slice) and adds "
        f"the temporaries of one chunk of {memory['chunk_size']} positions at most; `chunked_logprobs_entropy` "
        "computes the same log-probs and entropy from the final hidden states, one chunk of logits at a time, so its "
        "peak does not grow with T.",
        "",
        "| T | fp32 logits | upstream forward | + D3S entropy | chunked kernel |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in memory["rows"]:
        cells = [row["tokens"], row["logits_fp32_mib"], row["upstream_mib"], row["upstream_tap_mib"], row["chunked_mib"]]
        lines.append("| " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    return lines


def forward_section(forward):
    """Peak memory and time of the actor's forwards on OpenRLHF's Actor (bench_forward.py)."""
    lines = [
        "## 5. The actor's forwards without full logits",
        "",
        f"Command: `PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_forward.py` ({forward['date']}, "
        f"{forward['machine']}). OpenRLHF's `Actor` around a randomly initialised model ({forward['model']}); one "
        f"sequence of T tokens, A = T/2 action tokens. Peak extra memory (MiB, torch's CPU allocator events) and "
        f"wall time (best of {forward['repeats']}). "
        "Experience-making forward at a step with K < 1: upstream's log-prob forward; the same plus the entropy of "
        "its logits (`--d3s.full_logits`); the head-free forward (log-probs and entropy from the hidden states, chunk "
        "by chunk). Training step (forward and backward of the PG loss): upstream's forward over every position "
        "(also what runs at K = 1) against the LM head at the ceil(K·A) kept tokens only.",
        "",
        "| T | fp32 logits | experience: upstream | + entropy (full logits) | head-free | ratio to upstream |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in forward["rows"]:
        exp = row["experience"]
        lines.append(
            f"| {row['tokens']:,} | {row['logits_fp32_mib']:,.0f} | {exp['upstream']['peak_mib']:,.0f} MiB, "
            f"{exp['upstream']['seconds']:.2f} s | {exp['full_logits']['peak_mib']:,.0f} MiB, "
            f"{exp['full_logits']['seconds']:.2f} s | {exp['head_free']['peak_mib']:,.0f} MiB, "
            f"{exp['head_free']['seconds']:.2f} s | {exp['head_free']['peak_mib'] / exp['upstream']['peak_mib']:.2f}× "
            f"memory, {exp['head_free']['seconds'] / exp['upstream']['seconds']:.2f}× time |"
        )
    kept_names = [name for name in forward["rows"][0]["training"] if name != "upstream"]
    lines += [
        "",
        "| T | training: upstream (K = 1) | " + " | ".join(f"{name}" for name in kept_names) + " |",
        "|---:|---:|" + "---:|" * len(kept_names),
    ]
    for row in forward["rows"]:
        train = row["training"]
        base = train["upstream"]
        cells = [f"{base['peak_mib']:,.0f} MiB, {base['seconds']:.2f} s"]
        for name in kept_names:
            cell = train[name]
            cells.append(
                f"{cell['peak_mib']:,.0f} MiB ({cell['peak_mib'] / base['peak_mib']:.2f}×), {cell['seconds']:.2f} s "
                f"({cell['seconds'] / base['seconds']:.2f}×)"
            )
        lines.append(f"| {row['tokens']:,} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The peaks include what every variant holds alike: the model body's activations and, in the training step, "
        "the gradient of the tied 151,936 × 896 embedding (545 MiB fp32), which dominates the kept-token peak at "
        "short T; the LM head's logits are what changes. At K = 1 there is no token mask and upstream's forward "
        "runs unchanged, so it is never slower there.",
    ]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--output", default=str(HERE / "RESULTS.md"))
    parser.add_argument(
        "--study",
        default=None,
        help="instead: the study report of this learning_study.json (bench_learning.py), written to --output",
    )
    options = parser.parse_args(argv)
    if options.study:
        return study_main(options.study, options.output)
    results = Path(options.results)
    selection = json.loads((results / "selection.json").read_text())
    cost = json.loads((results / "step_cost.json").read_text())
    learning = json.loads((results / "learning.json").read_text())

    target, start, methods = learning_analysis(learning)
    plot_step_cost(cost["points"], results / "step_cost.png")
    plot_learning(methods, target, results / "learning_reward.png", results / "learning_grad_norm.png")
    document = [
        "# Benchmarks: what D3S costs and saves",
        "",
        "Regenerate everything: `bash benchmarks/run_all.sh` (step cost, selection, memory and this page: about 35 minutes "
        "on 2 CPU cores; the learning section below is the 2026-11-21 run). Each section "
        "names its own command, machine and date. CPU only: no GPU was available for these measurements.",
        "",
        *summary(cost, target, methods),
        "",
        *step_cost_section(cost),
        "",
        *learning_section(learning, target, start, methods),
        "",
        *selection_section(selection, cost, methods),
        "",
    ]
    if (results / "memory.json").exists():
        document += [*memory_section(json.loads((results / "memory.json").read_text())), ""]
    if (results / "forward.json").exists():
        document += [*forward_section(json.loads((results / "forward.json").read_text())), ""]
    Path(options.output).write_text("\n".join(document))
    print(f"wrote {options.output} and the plots in {results}")


if __name__ == "__main__":
    main()
