"""The prompt-skip study (``bench_learning.py --parts skip``: ``prompt_skip.json``): GRPO and D3S, each with and
without ``--d3s.prompt_skip history``, over several passes of the same prompts; what each generated, how long it
took, and when it reached GRPO's final held-out greedy accuracy, against the issue's goal for D3S + skip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .stats import mean_std, p_text, thirds
from .study import first_at_least, study_analysis

GOAL = 0.5  # D3S + skip: at most this share of GRPO's generated tokens and wall time to GRPO's final accuracy
ALPHA = 0.05


def _generated(run):
    """Cumulative response tokens generated per step (every generated rollout, filtered or not)."""
    return np.cumsum([s["rollout/response_length_mean"] * s["rollout/num_samples"] for s in run["steps"]])


def _skip_rate(run, group):
    """Per step: skipped prompts / prompts drawn (skipped + generated)."""
    rates = []
    for s in run["steps"]:
        skipped = s.get("d3s/skipped_prompts", 0.0)
        rates.append(skipped / (skipped + s["rollout/num_samples"] / group))
    return rates


def skip_analysis(document):
    """Per method: the study's analysis (``study_analysis``) plus generated tokens, generation time and wall time,
    in total and to GRPO's final held-out greedy accuracy (seed-mean curves), and the skip rate."""
    info = study_analysis(document)["skip"]["info"]
    target = float(np.mean(info["GRPO"]["final_greedy"]))
    raw = document["results"]["skip"]
    for method, m in info.items():
        runs = list(raw[method].values())
        generated = [_generated(run) for run in runs]
        m["generated_total"] = float(np.mean([g[-1] for g in generated]))
        m["generation_total"] = float(np.mean([r["generation"][-1] for r in m["runs"]]))
        m["wall_total"] = float(np.mean([r["wall"][-1] for r in m["runs"]]))
        m["steps_run"] = float(np.mean([len(r["reward"]) for r in m["runs"]]))
        n_steps = min(len(run["steps"]) for run in runs)  # skipping runs end at different steps
        m["skip_thirds"] = thirds(np.mean([_skip_rate(run, m["group"])[:n_steps] for run in runs], axis=0))
        m["zero_var_thirds"] = thirds(np.mean([r["zero_var"][:n_steps] for r in m["runs"]], axis=0))
        hit = first_at_least(m["curve"], target)
        step = int(m["eval_step"][hit]) if hit is not None else None
        m["to_target"] = dict(step=step)
        if step:
            m["to_target"].update(
                generated=float(np.mean([g[step - 1] for g in generated])),
                generation=float(np.mean([r["generation"][step - 1] for r in m["runs"]])),
                wall=float(np.mean([r["wall"][step - 1] for r in m["runs"]])),
            )
    return target, info


def _ratio(m, grpo, key):
    if not m["to_target"].get(key) or not grpo["to_target"].get(key):
        return None
    return m["to_target"][key] / grpo["to_target"][key]


def verdict(info):
    """The goal for D3S + skip, in words: reached GRPO's final accuracy with at most half its generated tokens and
    wall time, with a final accuracy within seed noise of GRPO's or better."""
    m, grpo = info["D3S+skip"], info["GRPO"]
    tokens, wall = _ratio(m, grpo, "generated"), _ratio(m, grpo, "wall")
    final, base = float(np.mean(m["final_greedy"])), float(np.mean(grpo["final_greedy"]))
    p = m["test_vs_grpo"][1]
    worse = final < base and not np.isnan(p) and p < ALPHA
    if tokens is None or wall is None:
        return (
            f"**Not met**: D3S + skip's seed-mean held-out greedy curve never reached GRPO's final accuracy "
            f"({base:.3f}; its best evaluation {float(np.max(m['curve'][1:])):.3f}, its final {final:.3f}, p = "
            f"{p_text(m['test_vs_grpo'])}). Over the whole run it generated "
            f"{m['generated_total'] / grpo['generated_total']:.2f}x GRPO's tokens in "
            f"{m['wall_total'] / grpo['wall_total']:.2f}x its wall time (goal: at most {GOAL}x each, to GRPO's final "
            "accuracy)."
        )
    met = tokens <= GOAL and wall <= GOAL and not worse
    return (
        f"**{'Met' if met else 'Not met'}**: D3S + skip reached GRPO's final held-out greedy accuracy ({base:.3f}) "
        f"with {tokens:.2f}x GRPO's generated tokens and {wall:.2f}x its wall time (goal: at most {GOAL}x each), "
        f"final accuracy {final:.3f} against {base:.3f} (p = {p_text(m['test_vs_grpo'])}"
        f"{', significantly worse' if worse else ''})."
    )


def skip_body(document, heading="###"):
    target, info = skip_analysis(document)
    grpo = info["GRPO"]
    seeds = len(grpo["final_greedy"])
    results = document["results"]["skip"]
    dates = sorted({run["date"] for runs in results.values() for run in runs.values()})
    minutes = sum(run["process_seconds"] + run["eval_seconds"] for runs in results.values() for run in runs.values())
    prompts = document["prompts_per_step"] * document["steps"]
    lines = [
        f"Command: `.venv/bin/python benchmarks/bench_learning.py --parts skip --eval-every {document['eval_every']} "
        f"--out benchmarks/results` ({', '.join(dates)}; {document['machine']}; {minutes / 60:.0f} minutes of runs "
        f"and evaluations{', plus the SFT warm start' if 'sft_seconds' in document else ''}). Task "
        f"`{document['task']}`: {prompts} RL prompts ({document['prompts_per_step']} a step, G = {grpo['group']} "
        f"rollouts each), {document['epochs']} passes over them ({document['steps'] * document['epochs']} steps "
        f"without skipping), {seeds} seeds; held-out greedy accuracy of the SFT start "
        f"{document['sft_heldout']['greedy']:.3f}. GRPO's final held-out greedy accuracy (seed mean): {target:.3f}.",
        "",
        "| method | steps run | final greedy | peak greedy | p vs GRPO | generated tokens | generation s | wall s | "
        "to GRPO's final: step | generated tokens | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in info.items():
        to = m["to_target"]
        reach = "never" if to["step"] is None else str(to["step"])
        tokens_ratio, wall_ratio = _ratio(m, grpo, "generated"), _ratio(m, grpo, "wall")
        tokens = "-" if tokens_ratio is None else f"{to['generated']:,.0f} ({tokens_ratio:.2f}x)"
        wall = "-" if wall_ratio is None else f"{to['wall']:.0f} ({wall_ratio:.2f}x)"
        lines.append(
            f"| {method} | {m['steps_run']:.0f} | {mean_std(m['final_greedy'])} | {mean_std(m['peak_greedy'])} | "
            f"{p_text(m['test_vs_grpo'])} | {m['generated_total']:,.0f} | {m['generation_total']:.0f} | "
            f"{m['wall_total']:.0f} | {reach} | {tokens} | {wall} |"
        )
    lines += [
        "",
        "Over training (means of the first, middle and last third of each run's steps; seed means):",
        "",
        "| method | zero-variance groups (share) | prompts skipped (share of those drawn) |",
        "|---|---|---|",
    ]
    for method, m in info.items():
        zero = " / ".join(f"{v:.2f}" for v in m["zero_var_thirds"])
        skipped = " / ".join(f"{v:.2f}" for v in m["skip_thirds"])
        lines.append(f"| {method} | {zero} | {skipped} |")
    lines += ["", f"{heading} Verdict", "", verdict(info)]
    if document.get("quick"):
        lines += ["", "This is a smoke test (`--quick`): too few steps for any conclusion."]
    return lines


def skip_section(path, number):
    """The RESULTS.md section of ``prompt_skip.json``."""
    document = json.loads(Path(path).read_text())
    return [f"## {number}. Prompt skipping before generation, over several passes", "", *skip_body(document)]


def skip_main(path, output):
    """The skip study alone, written to ``output``; returns ``output``."""
    document = json.loads(Path(path).read_text())
    lines = [f"# Prompt skipping before generation on `{document['task']}`", "", *skip_body(document, heading="##")]
    Path(output).write_text("\n".join(lines) + "\n")
    print(f"wrote {output}")
    return output
