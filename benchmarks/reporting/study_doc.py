"""The learning study in the documents: its plot, one table per part, the claims' lines and early learning."""

from __future__ import annotations

import numpy as np

from .claims import drift_line
from .stats import mean_std, p_text, thirds, trailing_mean, welch_t_test
from .study import SMOOTH

STUDY_COLORS = {
    "GRPO": "tab:gray",
    "PODS": "tab:orange",
    "PODS-random": "tab:brown",
    "PODS-max-reward": "tab:pink",
    "D1S": "tab:purple",
    "D1S-Cross": "tab:olive",
    "D2S": "tab:cyan",
    "D3S": "tab:blue",
    "D3S-I": "tab:green",
}


def plot_study(parts, path):
    """Per part (a row): the seed-mean held-out greedy curves with their seed range, the share of zero-variance
    groups and the actor's gradient norm per step, one colour per method."""
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
            zero_var = np.nanmean([r["zero_var"] for r in m["runs"]], axis=0)
            row[1].plot(steps, trailing_mean(zero_var, SMOOTH), color=color)
            row[2].plot(steps, trailing_mean(np.mean([r["grad"] for r in m["runs"]], axis=0), SMOOTH), color=color)
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
            + ", ".join(f"{m} {p_text(welch_t_test(info[m]['mean_greedy'], grpo['mean_greedy']))}" for m in others)
            + "."
        )
    return lines


def study_body(document, parts, plot_path, found, heading="##"):
    """The study's description, one table per part, the plot and the claims (``claims``' lines), under
    ``heading``-level parts."""
    runs = [run for methods in document["results"].values() for seeds in methods.values() for run in seeds.values()]
    dates = sorted({run["date"] for run in runs})
    config = document["task_config"]
    quick = document.get("quick", False)
    lines = [
        f"Command: `.venv/bin/python benchmarks/bench_learning.py{' --quick' if quick else ''} --task "
        f"{document['task']} --precision {document.get('precision', 'bf16')}` (methods and flags in its docstring) "
        f"· machine: {document['machine']} · {' to '.join(dict.fromkeys([dates[0], dates[-1]]))}.",
        "",
        *(
            [
                "A `--quick` smoke test: it checks that the chain runs; its numbers and verdicts say nothing of the "
                "claims.",
                "",
            ]
            if quick
            else []
        ),
        f"Task `{document['task']}`; SFT warm start on {config['n_sft']} examples x {config['sft_epochs']} epochs "
        f"(held-out greedy {document['sft_heldout']['greedy']:.3f}, sampled {document['sft_heldout']['sampled']:.3f}"
        + ("" if document.get("sft_seconds") is None else f"; {document['sft_seconds'] / 60:.1f} min")
        + f"), then every method from it: {document['prompts_per_step']} prompts per step, held-out evaluation of "
        f"{config['n_heldout']} prompts every {document['eval_every']} steps (greedy, and {document['eval_samples']} "
        "samples per prompt at T = 1). Every method shares every hyperparameter but its rollout counts and "
        "`--d3s.*` flags; none was tuned, and none on the held-out split.",
        "",
        'Accuracies are mean ± standard deviation over seeds. "Reaches GRPO" is the first evaluation at which the '
        "seed-mean held-out greedy accuracy is at least GRPO's final one (the part's dotted line), with the trained "
        "(policy-gradient) tokens and the summed step time (`timing/step_total`) up to that step, and the share of "
        'that time spent generating. "Mean greedy": the held-out greedy accuracy averaged over the evaluations '
        "(how fast and how far a method learns). p: two-sided Welch t-test of the final greedy accuracy against "
        "GRPO's (3 seeds give the test little power: a large p is no evidence of equality).",
        "",
    ]
    for part, analysed in parts.items():
        target, info = analysed["target"], analysed["info"]
        lines += [
            f"{heading} Part `{part}`"
            + ("" if target is None else f" (GRPO's final held-out greedy accuracy {target:.3f})"),
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
            share = "" if r["generation_share"] is None else f" ({100 * r['generation_share']:.0f}%)"
            wall = "-" if r["wall"] is None else f"{r['wall']:.0f} s{share}"
            tokens = "-" if r["tokens"] is None else f"{r['tokens'] / 1e3:.1f}k"
            p = "-" if method == "GRPO" or "test_vs_grpo" not in m else p_text(m["test_vs_grpo"])
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
