"""Turn the benchmark results into ``benchmarks/RESULTS.md`` with its plots (``benchmarks/results/*.png``).

    .venv/bin/python benchmarks/report.py [--results benchmarks/results]

Reads ``step_cost.json`` (bench_step_cost.py), ``learning_study.json`` (bench_learning.py, section 2),
``selection.json`` (bench_selection.py), ``memory.json`` and ``forward.json``. ``--study learning_study.json
--output STUDY.md`` instead writes the study alone (tables, Welch tests, the claims, ``STUDY.png``). Every number,
comparison and verdict in the document is computed here from those files, so a rerun of
``benchmarks/run_all.sh`` regenerates the whole document consistently.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SMOOTH = 10  # steps of the trailing mean of the per-step curves in the study's plot
PAPER_SPEEDUP = {"D3S": 2.04, "PODS": 1.7}  # D3S: 2.04x faster than GRPO; PODS: >= 1.7x sooner to GRPO's peak
ALPHA = 0.05  # a difference is called resolved when the Welch test's p is below this


def trailing_mean(values, window=SMOOTH):
    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


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


def selection_section(selection, cost, parts):
    rows = {(r["prompts"], r["group"], r["scope"]): r for r in selection["rows"]}
    big = rows.get((1024, 64, "cross"))
    step_cost_shares = [p["select_time_s"] / p["timing/step_total"] for p in cost["points"][1:]]
    study_shares = [
        float(np.median(run["select_share"]))
        for analysed in (parts or {}).values()
        for method, m in analysed["info"].items()
        if method != "GRPO"
        for run in m["runs"]
    ]
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
        "tokens)"
        + ("." if not study_shares else f" and {100 * statistics.median(study_shares):.2f}% in the study's runs "
           "(section 2: steps of about a second)."),
    ]
    if big is not None:
        lines.append(
            f"- At 1024 prompts x 64 rollouts (65,536 rollouts) cross-group selection "
            f"takes {big['ours_ms']:.1f} ms: it would reach 1% of a step only if the whole step (generation of 65k "
            f"responses, forwards, update) took under {big['ours_ms'] * 100 / 1e3:.1f} s."
        )
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
    norm, the selection's share of the step; the held-out curve as arrays."""
    steps = run["steps"]
    tokens = np.cumsum(
        [s.get("d3s/kept_tokens", s["rollout/response_length_mean"] * s["rollout/num_samples"]) for s in steps]
    )
    return dict(
        reward=np.array([s["rollout/reward_mean"] for s in steps]),
        tokens=tokens,
        wall=np.cumsum([s["timing/step_total"] for s in steps]),
        generation=np.cumsum([s["timing/generation"] for s in steps]),
        step_time={key: np.array([s[key] for s in steps]) for key in STEP_TIMINGS},
        select_share=np.array([s.get("d3s/select_time_s", 0.0) / s["timing/step_total"] for s in steps]),
        zero_var=np.array([s.get("d3s/zero_var_groups", np.nan) / prompts for s in steps]),
        grad=np.array([s["actor_grad_norm"] for s in steps]),
        eval_step=np.array([e["step"] for e in run["heldout"]]),
        greedy=np.array([e["greedy"] for e in run["heldout"]]),
        sampled=np.array([e["sampled"] for e in run["heldout"]]),
        entropy=np.array([e["entropy"] for e in run["heldout"]]),
    )


STEP_TIMINGS = ("timing/generation", "timing/make_experience", "timing/ppo_train", "timing/step_total")


def thirds(values):
    chunks = np.array_split(np.asarray(values, dtype=float), 3)
    return [float(np.nanmean(c)) if np.isfinite(c).any() else float("nan") for c in chunks]  # short runs: nan


def first_at_least(curve, target):
    """Index of the first value of ``curve`` at least ``target``, or None; the tolerance lets GRPO's curve reach
    its own values."""
    hits = np.nonzero(curve >= target - 1e-9)[0]
    return int(hits[0]) if len(hits) else None


def reach(m, target):
    """First evaluation at which method ``m``'s seed-mean held-out greedy curve is at least ``target``:
    ``{"step", "tokens", "wall", "generation_share"}`` (seed means up to that step), all None if never."""
    hit = first_at_least(m["curve"], target)
    if hit is None:
        return dict(step=None, tokens=None, wall=None, generation_share=None)
    step = int(m["eval_step"][hit])
    if step == 0:
        return dict(step=0, tokens=0.0, wall=0.0, generation_share=None)
    wall = float(np.mean([r["wall"][step - 1] for r in m["runs"]]))
    return dict(
        step=step,
        tokens=float(np.mean([r["tokens"][step - 1] for r in m["runs"]])),
        wall=wall,
        generation_share=float(np.mean([r["generation"][step - 1] for r in m["runs"]]) / wall),
    )


def reach_reward(m, target):
    """First step at which method ``m``'s seed-mean training reward (all generated rollouts, T = 1; SMOOTH-step
    trailing mean) is at least ``target``: ``{"step", "wall"}``, None if never. Per step, unlike the held-out
    curve: a finer, if in-sample, clock."""
    hit = first_at_least(m["reward_curve"], target)
    if hit is None:
        return dict(step=None, wall=None)
    return dict(step=hit + 1, wall=float(np.mean([r["wall"][hit] for r in m["runs"]])))


def study_analysis(document):
    """Per part and method: seed lists of final, peak and mean (over the evaluations) held-out accuracy, time to
    GRPO's final and peak held-out greedy accuracy (seed-mean curves) in steps, trained tokens and wall time, and
    the training-dynamics summaries."""
    prompts = document["prompts_per_step"]
    sft = document["sft_heldout"]
    parts = {}
    for part, methods in document["results"].items():
        info = {}
        for method, seeds in methods.items():
            runs = [study_run(run, prompts) for run in seeds.values()]
            n_eval = min(len(r["eval_step"]) for r in runs)
            n_steps = min(len(r["reward"]) for r in runs)
            curve = np.mean([np.concatenate([[sft["greedy"]], r["greedy"][:n_eval]]) for r in runs], axis=0)
            info[method] = dict(
                runs=runs,
                seeds=list(seeds),
                group=next(iter(seeds.values()))["group"],
                eval_step=np.concatenate([[0], runs[0]["eval_step"][:n_eval]]),
                curve=curve,
                final_greedy=[float(r["greedy"][n_eval - 1]) for r in runs],
                final_sampled=[float(r["sampled"][n_eval - 1]) for r in runs],
                peak_greedy=[float(r["greedy"][:n_eval].max()) for r in runs],
                mean_greedy=[float(r["greedy"][:n_eval].mean()) for r in runs],
                drop=[float(r["greedy"][:n_eval].max() - r["greedy"][n_eval - 1]) for r in runs],
                final_entropy=[float(r["entropy"][n_eval - 1]) for r in runs],
                grad_mean=[float(r["grad"].mean()) for r in runs],
                tokens_total=float(np.mean([r["tokens"][-1] for r in runs])),
                step_time={key: float(np.mean([r["step_time"][key].mean() for r in runs])) for key in STEP_TIMINGS},
                reward_curve=trailing_mean(np.mean([r["reward"][:n_steps] for r in runs], axis=0)),
            )
        target = peak = None
        if "GRPO" in info:
            target = float(np.mean(info["GRPO"]["final_greedy"]))
            peak = float(info["GRPO"]["curve"][1:].max())
            reward_final = float(info["GRPO"]["reward_curve"][-1])
            reward_peak = float(info["GRPO"]["reward_curve"].max())
            for m in info.values():
                m["reach_final"] = reach(m, target)
                m["reach_peak"] = reach(m, peak)
                m["reward_reach_final"] = reach_reward(m, reward_final)
                m["reward_reach_peak"] = reach_reward(m, reward_peak)
                m["test_vs_grpo"] = welch_t_test(m["final_greedy"], info["GRPO"]["final_greedy"])
        parts[part] = dict(target=target, peak=peak, info=info)
    return parts


def plot_study(parts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(parts), 3, figsize=(15, 4 * len(parts)), squeeze=False)
    for row, (part, analysed) in zip(axes, parts.items()):
        for method, m in analysed["info"].items():
            color = STUDY_COLORS.get(method)
            seeds = np.array([np.concatenate([[m["curve"][0]], r["greedy"][: len(m["curve"]) - 1]]) for r in m["runs"]])
            row[0].plot(m["eval_step"], m["curve"], "o-", color=color, label=method)
            row[0].fill_between(m["eval_step"], seeds.min(0), seeds.max(0), color=color, alpha=0.12)
            steps = np.arange(1, len(m["runs"][0]["zero_var"]) + 1)
            row[1].plot(steps, trailing_mean(np.nanmean([r["zero_var"] for r in m["runs"]], axis=0)), color=color)
            row[2].plot(steps, trailing_mean(np.mean([r["grad"] for r in m["runs"]], axis=0)), color=color)
        if analysed["target"] is not None:
            row[0].axhline(analysed["target"], color="black", linestyle=":", linewidth=1)
        row[0].set_ylabel(f"{part}: held-out greedy accuracy")
        row[1].set_ylabel(f"share of zero-variance groups ({SMOOTH}-step mean)")
        row[2].set_ylabel(f"actor grad norm ({SMOOTH}-step mean)")
        for axis in row:
            axis.set_xlabel("RL step")
            axis.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _p(test):
    return "-" if math.isnan(test[1]) else f"{test[1]:.2f}"


def _speedup(base, method):
    """GRPO's wall time / the method's to the same accuracy, or None if either never reached it."""
    if base["wall"] is None or method["wall"] is None or method["wall"] == 0:
        return None
    return base["wall"] / method["wall"]


def _reach_text(r):
    return "never" if r["step"] is None else f"at step {r['step']} ({r['wall']:.0f} s of steps)"


def _reward_speedup(grpo, method, which):
    """GRPO's wall time / the method's to GRPO's ``which`` (final or peak) smoothed training reward, or None."""
    return _speedup(grpo[f"reward_reach_{which}"], method[f"reward_reach_{which}"])


def _reward_clock(grpo, method, which, name):
    """The same race on the per-step training reward (GRPO's ``which`` = final or peak smoothed reward)."""
    key = f"reward_reach_{which}"
    base, other = grpo[key], method[key]
    if other["step"] is None:
        return f"On the training reward ({SMOOTH}-step mean, per step) {name} never reaches GRPO's {which} value."
    text = (
        f"On the training reward ({SMOOTH}-step mean, per step) GRPO reaches its {which} value at step {base['step']} "
        f"({base['wall']:.0f} s), {name} at step {other['step']} ({other['wall']:.0f} s)"
    )
    speedup = _reward_speedup(grpo, method, which)
    return text + ("." if speedup is None else f": {speedup:.2f}x in wall time.")


def _speed_verdict(heldout, reward, claimed, drift):
    """``(verdict, qualifier)`` on "at least ``claimed``x faster" from the measured wall-time speedups on the
    held-out clock and on the training-reward clock (None where the method never got there); ``drift``: the
    relative spread of the same method's step time over seeds, which a wall-time ratio cannot resolve. Only the
    held-out clock can agree (the training reward is in-sample); either clock within the drift of the claim leaves
    it unresolved."""
    if heldout is not None and heldout >= claimed:
        return AGREES, ""
    if heldout is not None and heldout * (1 + drift) >= claimed:
        return UNRESOLVED, " (within the machine's drift of the claimed factor)"
    if reward is not None and reward * (1 + drift) >= claimed:
        within = "" if reward >= claimed else ", within the machine's drift"
        return UNRESOLVED, f" (only the in-sample training-reward clock shows the factor{within})"
    return DISAGREES, " (held-out accuracy: never reached within the run)" if heldout is None else ""


def step_time_drift(parts):
    """The largest relative spread (max - min) / mean over seeds of one method's mean step time."""
    spreads = [0.0]
    for analysed in parts.values():
        for m in analysed["info"].values():
            times = [r["step_time"]["timing/step_total"].mean() for r in m["runs"]]
            spreads.append((max(times) - min(times)) / np.mean(times))
    return float(max(spreads))


def _order_verdict(tests):
    """Verdict on a claimed ordering a > b > c from the Welch tests of its adjacent pairs (t > 0: as claimed)."""
    if any(t < 0 and p < ALPHA for t, p in tests):
        return DISAGREES
    if all(t > 0 and p < ALPHA for t, p in tests):
        return AGREES
    return UNRESOLVED


AGREES, DISAGREES, UNRESOLVED = "agrees", "disagrees", "not resolved at this scale"


@dataclass(frozen=True)
class Claim:
    """A paper's claim and what the study shows; ``line``: ``- {label}: **{verdict}**{detail}``."""

    label: str  # who claims what, e.g. 'D3S, "2.04x faster than GRPO"'
    verdict: str  # AGREES, DISAGREES or UNRESOLVED
    detail: str  # the numbers, right after the verdict (". GRPO's final ..." or " (qualifier). ...")

    @property
    def line(self):
        return f"- {self.label}: **{self.verdict}**{self.detail}"


def drift_line(parts):
    """What the machine's drift of step times means for the wall-time claims."""
    return (
        f"- Machine drift: one method's mean step time varied by up to {100 * step_time_drift(parts):.0f}% between "
        "seeds (the same flags, hence the same work): wall-time ratios closer than that to a claimed factor are not "
        "resolved; steps and trained tokens are unaffected."
    )


def claims(parts, eval_every):
    """The papers' claims (:class:`Claim`), each with what the study shows (agrees / disagrees / not resolved)."""
    drift = step_time_drift(parts)
    found = []
    pods, family = parts.get("pods"), parts.get("d3s")
    resolution = f"(evaluations every {eval_every} steps bound the resolution of every time-to-accuracy)"
    if pods and {"GRPO", "PODS"} <= set(pods["info"]):
        grpo, method = pods["info"]["GRPO"], pods["info"]["PODS"]
        speedup = _speedup(grpo["reach_peak"], method["reach_peak"])
        reward = _reward_speedup(grpo, method, "peak")
        verdict, qualifier = _speed_verdict(speedup, reward, PAPER_SPEEDUP["PODS"], drift)
        found.append(Claim(
            f"PODS, \"reaches GRPO's peak at least {PAPER_SPEEDUP['PODS']}x sooner\"",
            verdict,
            f"{qualifier}. GRPO (n = m = {grpo['group']}) peaks at "
            f"{pods['peak']:.3f} held-out greedy, reached first {_reach_text(grpo['reach_peak'])}; PODS (n = "
            f"{method['group']}, m = {grpo['group']}) reaches it {_reach_text(method['reach_peak'])}"
            + ("" if speedup is None else f": {speedup:.2f}x in wall time")
            + f" {resolution}. {_reward_clock(grpo, method, 'peak', 'PODS')} Final greedy "
            f"{mean_std(method['final_greedy'])} against GRPO's {mean_std(grpo['final_greedy'])} "
            f"(p = {_p(method['test_vs_grpo'])})."
        ))  # fmt: skip
    rules = ["PODS", "PODS-random", "PODS-max-reward"]
    if pods and set(rules) <= set(pods["info"]):
        ms = [pods["info"][r] for r in rules]
        tests = [welch_t_test(a["mean_greedy"], b["mean_greedy"]) for a, b in zip(ms, ms[1:])]
        found.append(Claim(
            "PODS's rule ablation, \"max-variance > random > max-reward\" (82.6 / 81.6 / 67.3 on GSM8K)",
            _order_verdict(tests),
            ". Held-out greedy accuracy averaged over the run's evaluations (how fast and how "
            f"far it learns): {' / '.join(mean_std(m['mean_greedy']) for m in ms)}; final "
            f"{' / '.join(mean_std(m['final_greedy']) for m in ms)}. Welch p of max-variance vs random "
            f"{_p(tests[0])}, random vs max-reward {_p(tests[1])}."
        ))  # fmt: skip
    if not family or "GRPO" not in family["info"]:
        return found
    info = family["info"]
    grpo = info["GRPO"]
    if "D3S" in info:
        d3s = info["D3S"]
        speedup = _speedup(grpo["reach_final"], d3s["reach_final"])
        steps = None
        if d3s["reach_final"]["step"] and grpo["reach_final"]["step"]:
            steps = grpo["reach_final"]["step"] / d3s["reach_final"]["step"]
        reward = _reward_speedup(grpo, d3s, "final")
        verdict, qualifier = _speed_verdict(speedup, reward, PAPER_SPEEDUP["D3S"], drift)
        found.append(Claim(
            f"D3S, \"{PAPER_SPEEDUP['D3S']}x faster than GRPO\"",
            verdict,
            f"{qualifier}. GRPO's final held-out greedy {family['target']:.3f} is first reached by GRPO "
            f"{_reach_text(grpo['reach_final'])}, by D3S {_reach_text(d3s['reach_final'])}"
            + ("" if speedup is None else f": {speedup:.2f}x in wall time, {steps:.2f}x in steps")
            + f" {resolution}. {_reward_clock(grpo, d3s, 'final', 'D3S')} Final greedy "
            f"{mean_std(d3s['final_greedy'])} against GRPO's {mean_std(grpo['final_greedy'])} "
            f"(p = {_p(d3s['test_vs_grpo'])})."
        ))  # fmt: skip
        share = d3s["tokens_total"] / grpo["tokens_total"]
        found.append(Claim(
            'D3S, "under 20% of the tokens"',
            AGREES if share < 0.2 else DISAGREES,
            f". D3S trained on {100 * share:.1f}% of GRPO's policy-gradient tokens over the run "
            f"({d3s['tokens_total'] / 1e3:.1f}k against {grpo['tokens_total'] / 1e3:.1f}k, seed means); this follows "
            "from the schedule's N and K and the zero-variance groups, not from learning."
        ))  # fmt: skip
        test = welch_t_test(d3s["grad_mean"], grpo["grad_mean"])
        baseline = np.mean(grpo["grad_mean"])  # 0 when every GRPO group had equal rewards
        ratio = f"{np.mean(d3s['grad_mean']) / baseline:.2f}x" if baseline > 0 else "no ratio: GRPO's norm is 0"
        found.append(Claim(
            'D3S, "a higher gradient norm"',
            _order_verdict([test]),
            f". Mean actor gradient norm over the run {mean_std(d3s['grad_mean'], '{:.2f}')} against GRPO's "
            f"{mean_std(grpo['grad_mean'], '{:.2f}')} "
            f"({ratio}, Welch p = {_p(test)}; OpenRLHF logs the norm of a step's last optimizer step)."
        ))  # fmt: skip
    if {"D1S", "D2S", "D3S"} <= set(info):
        tests = [welch_t_test(info[m]["drop"], info["D3S"]["drop"]) for m in ("D1S", "D2S")]
        drops = ", ".join(f"{m} {mean_std(info[m]['drop'])}" for m in ("D1S", "D2S", "D3S"))
        found.append(Claim(
            'D3S, "D1S and D2S overfit without the schedule"',
            _order_verdict(tests),
            ". Read as a held-out greedy accuracy that falls from its peak by the end of the run (peak - final, per "
            f"seed): {drops}; Welch p against D3S: D1S {_p(tests[0])}, D2S {_p(tests[1])}. Final greedy: "
            + ", ".join(f"{m} {mean_std(info[m]['final_greedy'])}" for m in ("D1S", "D2S", "D3S"))
            + ".",
        ))  # fmt: skip
    pairs = [(c, i) for c, i in (("D3S", "D3S-I"), ("D1S-Cross", "D1S")) if c in info and i in info]
    if pairs:
        verdicts, texts = [], []
        for cross, intra in pairs:
            spread = [float(np.std(info[m]["final_greedy"], ddof=1)) if len(info[m]["seeds"]) > 1 else 0.0
                      for m in (cross, intra)]  # fmt: skip
            fall = [float(max(0.0, -np.diff(info[m]["curve"]).min())) for m in (cross, intra)]
            verdicts.append((spread[0] > spread[1]) + (fall[0] > fall[1]))
            texts.append(
                f"{cross} against {intra}: seed spread of the final greedy {spread[0]:.3f} vs {spread[1]:.3f}, "
                f"largest fall between evaluations of the seed-mean curve {fall[0]:.3f} vs {fall[1]:.3f}"
            )
        verdict = (
            AGREES if all(v == 2 for v in verdicts)
            else DISAGREES if all(v == 0 for v in verdicts)
            else UNRESOLVED
        )  # fmt: skip
        found.append(Claim(
            'D3S, "cross-group selection is less stable than intra-group" (seen on unaligned Llama3.1-8B-Instruct)',
            verdict,
            " (it would agree if cross were worse on both measures in every pair, disagree if better on both in "
            "every pair). " + "; ".join(texts) + ".",
        ))  # fmt: skip
    return found


def early_learning(parts):
    """Per part: each method's seed-mean held-out greedy accuracy at the first evaluation against GRPO's, and the
    Welch test of the accuracy averaged over the evaluations, which the time-to-GRPO's-final race (decided where
    every method saturates) cannot show."""
    lines = []
    for part, analysed in parts.items():
        info = analysed["info"]
        if "GRPO" not in info or len(info) < 2:
            continue
        grpo = info["GRPO"]
        others = [m for m in info if m != "GRPO"]
        ahead = sum(info[m]["curve"][1] > grpo["curve"][1] for m in others)
        higher = sum(np.mean(info[m]["mean_greedy"]) > np.mean(grpo["mean_greedy"]) for m in others)
        lines.append(
            f"- Part `{part}`, first evaluation (step {grpo['eval_step'][1]}): GRPO {grpo['curve'][1]:.3f}, "
            + ", ".join(f"{m} {info[m]['curve'][1]:.3f}" for m in others)
            + f" ({ahead} of {len(others)} above GRPO). Mean greedy above GRPO's in {higher} of {len(others)}; "
            "Welch p against GRPO: "
            + ", ".join(f"{m} {_p(welch_t_test(info[m]['mean_greedy'], grpo['mean_greedy']))}" for m in others)
            + "."
        )
    return lines


def study_body(document, parts, plot_path, found, heading="##"):
    """The study's description, one table per part, the plot and the claims (``claims``' lines), under
    ``heading``-level parts."""
    dates = sorted({run["date"] for methods in document["results"].values() for seeds in methods.values()
                    for run in seeds.values()})  # fmt: skip
    config = document["task_config"]
    quick = document.get("quick", False)
    lines = [
        f"Command: `.venv/bin/python benchmarks/bench_learning.py{' --quick' if quick else ''} --task "
        f"{document['task']} --precision {document.get('precision', 'bf16')}` (methods and flags in its docstring) "
        f"· machine: {document['machine']} · {' to '.join(dict.fromkeys([dates[0], dates[-1]]))}.",
        "",
        *(["A `--quick` smoke test: it checks that the chain runs; its numbers and verdicts say nothing of the "
           "claims.", ""] if quick else []),
        f"Task `{document['task']}`; SFT warm start on {config['n_sft']} examples x {config['sft_epochs']} epochs "
        f"(held-out greedy {document['sft_heldout']['greedy']:.3f}, sampled {document['sft_heldout']['sampled']:.3f}"
        + ("" if document.get("sft_seconds") is None else f"; {document['sft_seconds'] / 60:.1f} min")
        + f"), then every method from it: {document['prompts_per_step']} prompts per step, held-out evaluation of "
        f"{config['n_heldout']} prompts every {document['eval_every']} steps (greedy, and {document['eval_samples']} "
        "samples per prompt at T = 1). Every method shares every hyperparameter but its rollout counts and "
        "`--d3s.*` flags; none was tuned, and none on the held-out split.",
        "",
        "Accuracies are mean ± standard deviation over seeds. \"Reaches GRPO\" is the first evaluation at which the "
        "seed-mean held-out greedy accuracy is at least GRPO's final one (the part's dotted line), with the trained "
        "(policy-gradient) tokens and the summed step time (`timing/step_total`) up to that step, and the share of "
        "that time spent generating. \"Mean greedy\": the held-out greedy accuracy averaged over the evaluations "
        "(how fast and how far a method learns). p: two-sided Welch t-test of the final greedy accuracy against "
        "GRPO's (3 seeds give the test little power: a large p is no evidence of equality).",
        "",
    ]
    for part, analysed in parts.items():
        target, info = analysed["target"], analysed["info"]
        lines += [
            f"{heading} Part `{part}`" + ("" if target is None else f" (GRPO's final held-out greedy accuracy {target:.3f})"),
            "",
            "| method | G | seeds | final greedy | final sampled | peak greedy | mean greedy | reaches GRPO at step "
            "| trained tokens | wall time (generation share) | p vs GRPO | zero-var groups, thirds | grad norm, thirds "
            "| entropy, final | step time |",
            "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for method, m in info.items():
            zero = thirds(np.nanmean([r["zero_var"] for r in m["runs"]], axis=0))
            grad = thirds(np.mean([r["grad"] for r in m["runs"]], axis=0))
            r = m.get("reach_final", dict(step=None, tokens=None, wall=None, generation_share=None))
            reach_step = "not reached" if r["step"] is None else str(r["step"])
            wall = "-" if r["wall"] is None else (
                f"{r['wall']:.0f} s" + ("" if r["generation_share"] is None else f" ({100 * r['generation_share']:.0f}%)")
            )  # fmt: skip
            tokens = "-" if r["tokens"] is None else f"{r['tokens'] / 1e3:.1f}k"
            p = "-" if method == "GRPO" or "test_vs_grpo" not in m else _p(m["test_vs_grpo"])
            lines.append(
                f"| {method} | {m['group']} | {len(m['seeds'])} | {mean_std(m['final_greedy'])} | "
                f"{mean_std(m['final_sampled'])} | {mean_std(m['peak_greedy'])} | {mean_std(m['mean_greedy'])} | "
                f"{reach_step} | {tokens} | {wall} | {p} | {' / '.join(f'{z:.2f}' for z in zero)} | "
                f"{' / '.join(f'{g:.2f}' for g in grad)} | {mean_std(m['final_entropy'], '{:.2f}')} | "
                f"{m['step_time']['timing/step_total']:.2f} s |"
            )
        lines.append("")
    lines += [
        f"![study]({plot_path})",
        "",
        "**The papers' claims at this scale.**",
        drift_line(parts),
        *(claim.line for claim in found),
        "",
        "**Early learning** (before every method saturates).",
        *early_learning(parts),
    ]
    return lines


def study_main(path, output):
    document = json.loads(Path(path).read_text())
    parts = study_analysis(document)
    plot_path = Path(output).with_suffix(".png")
    plot_study(parts, plot_path)
    body = study_body(document, parts, plot_path.name, claims(parts, document["eval_every"]))
    lines = [f"# Learning-efficiency study on `{document['task']}`", "", *body]
    Path(output).write_text("\n".join(lines) + "\n")
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


def summary(cost, parts, found):
    """The headline numbers of the sections (``parts``: the analysed study and ``found`` its claims, None if not
    run)."""
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
    for part, analysed in (parts or {}).items():
        info = analysed["info"]
        if "GRPO" not in info:
            continue
        grpo = info["GRPO"]
        others = [m for m in info if m != "GRPO"]
        lines.append(
            f"- Study, part `{part}` (section 2): final held-out greedy GRPO {np.mean(grpo['final_greedy']):.3f}, "
            + ", ".join(f"{m} {np.mean(info[m]['final_greedy']):.3f} (p = {_p(info[m]['test_vs_grpo'])})" for m in others)
            + "; trained tokens against GRPO's: "
            + ", ".join(f"{m} {info[m]['tokens_total'] / grpo['tokens_total']:.2f}" for m in others)
            + "."
        )
    if parts:
        lines.append(
            "- The papers' claims at this scale (section 2): "
            + "; ".join(f"{claim.label}: {claim.verdict}" for claim in found)
            + "."
        )
    shares = [p["select_time_s"] / p["timing/step_total"] for p in cost["points"][1:]]
    lines.append(f"- Selection (section 3): at most {100 * max(shares):.2f}% of a step in the step-cost runs.")
    return lines


def study_section(results):
    """Section 2 of RESULTS.md from ``results/learning_study.json``, the analysed parts and the claims' lines
    (None, None if not run)."""
    path = results / "learning_study.json"
    heading = "## 2. Learning efficiency: the study"
    if not path.exists():
        return [heading, "", "Not run yet: `.venv/bin/python benchmarks/bench_learning.py` (see its docstring)."], None, None
    document = json.loads(path.read_text())
    parts = study_analysis(document)
    plot_study(parts, results / "learning_study.png")
    found = claims(parts, document["eval_every"])
    lines = [heading, "", *study_body(document, parts, "results/learning_study.png", found, heading="###")]
    return lines, parts, found


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
    plot_step_cost(cost["points"], results / "step_cost.png")
    study, parts, found = study_section(results)
    document = [
        "# Benchmarks: what D3S costs and saves",
        "",
        "Regenerate everything: `bash benchmarks/run_all.sh` (its header says how long each part takes on 2 CPU "
        "cores). Each section names its own command, machine and date. CPU only: no GPU was available for these "
        "measurements.",
        "",
        *summary(cost, parts, found),
        "",
        *step_cost_section(cost),
        "",
        *study,
        "",
        *selection_section(selection, cost, parts),
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
