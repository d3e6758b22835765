"""The learning study's analysis (``learning_study.json``, bench_learning.py): per run its per-step arrays, per part
and method the held-out accuracies over seeds, the time to GRPO's accuracy and the training dynamics."""

from __future__ import annotations

import numpy as np

from .stats import trailing_mean, welch_t_test

SMOOTH = 10  # steps of the trailing mean of the per-step curves (training reward, the plot's dynamics)
STEP_TIMINGS = ("timing/generation", "timing/make_experience", "timing/ppo_train", "timing/step_total")


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
        grad=np.array([s.get("actor_grad_norm", np.nan) for s in steps]),  # nan: a step that trained no batch
        eval_step=np.array([e["step"] for e in run["heldout"]]),
        greedy=np.array([e["greedy"] for e in run["heldout"]]),
        sampled=np.array([e["sampled"] for e in run["heldout"]]),
        entropy=np.array([e["entropy"] for e in run["heldout"]]),
    )


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
                grad_mean=[float(np.nanmean(r["grad"])) for r in runs],
                tokens_total=float(np.mean([r["tokens"][-1] for r in runs])),
                step_time={key: float(np.mean([r["step_time"][key].mean() for r in runs])) for key in STEP_TIMINGS},
                reward_curve=trailing_mean(np.mean([r["reward"][:n_steps] for r in runs], axis=0), SMOOTH),
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
