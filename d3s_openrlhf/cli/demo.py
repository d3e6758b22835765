"""The built-in default job: the whole pipeline on a toy verifiable task, on CPU (about 7 minutes on 2 cores).

    python -m d3s_openrlhf.cli.demo --out DIR

1. builds a character-level tokenizer and a 2-layer Llama locally (no hub) and the task's data and reward file
   from a task module (``--task``, see ``d3s_openrlhf.tasks``; default: chained addition with a written trace,
   "12+37+25=" -> "12+37=49,49+25=74;74", ``d3s_openrlhf/tasks/chainsum.py``, the speed study's task);
2. SFT warm start with OpenRLHF's ``openrlhf.cli.train_sft`` (chainsum: 4,000 traces that drop half the carries,
   12 epochs);
3. RL through ``d3s_openrlhf.cli.train_ppo_ray`` with OpenRLHF's vLLM engine, at the settings the speed study chose
   (``benchmarks/RESULTS.md`` section 1): one pass over 1,200 fresh prompts, 8 prompts x 16 rollouts a step (150
   steps), GRPO + D3S (cross-group max-variance rollout selection and |A|*H token selection on a linear schedule
   N 4 -> 12 rollouts per prompt, K 20% -> 50% of tokens) at lr 5e-5 (``--grpo-only``: GRPO at its own 2.5e-5).
   Both stages run in float32 under the CPU runtime (``python -m d3s_openrlhf.cli.cpu --fp32``);
4. reads the per-step metrics OpenRLHF logged (tensorboard), evaluates the SFT and the RL model on the held-out
   problems (chainsum: 256), each figure with its 95% interval and the change with its paired one, and writes
   ``DIR/summary.json`` and ``DIR/progress.png``.

Logs of every stage go to ``DIR/logs/``.
"""

import argparse
import ast
import json
import os
import re
import sys
import time

import numpy as np

from d3s_openrlhf.testbed import evaluate, pipeline

EVAL_SAMPLES = 8  # sampled responses per held-out prompt (pass@1 at T = 1 and pass@8)
STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})\s*$")
SFT_EPOCH = re.compile(r"Train epoch:\s+\d+%.*?\|\s*(\d+)/(\d+)")


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m d3s_openrlhf.cli.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument(
        "--task",
        default=pipeline.DEMO_TASK,
        help="task module (import path, or path of a .py file) defining make_examples and reward; see "
        "d3s_openrlhf.tasks (default: the chainsum task)",
    )
    parser.add_argument(
        "--episodes", type=int, default=1, help="passes over the RL prompts (chainsum: 1,200 prompts, 150 steps each)"
    )
    parser.add_argument("--sft-epochs", type=int, default=None, help="default: the task's (chainsum: 12)")
    parser.add_argument("--prompts", type=int, default=None, help="RL prompts (default: the task's; chainsum: 1,200)")
    parser.add_argument("--grpo-only", action="store_true", help="RL without D3S (the baseline to compare with)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class Progress:
    """Prints one line per stage event; the launcher's full output goes to the log files."""

    def __init__(self):
        self.t0 = time.time()
        self.last_epoch = None

    def say(self, text):
        print(f"[demo {time.time() - self.t0:6.0f}s] {text}", flush=True)

    def sft_line(self, line):
        match = SFT_EPOCH.search(line)
        if match and match.group(1) != "0" and match.groups() != self.last_epoch:
            self.last_epoch = match.groups()
            self.say(f"SFT epoch {match.group(1)}/{match.group(2)}")

    def rl_line(self, line):
        match = STEP_LINE.search(line)
        if not match:
            return
        status = ast.literal_eval(match.group(2))
        kept = status.get("d3s/kept_rollouts", status.get("rollout/num_samples"))
        self.say(
            f"RL step {match.group(1)}: reward {status.get('rollout/reward_mean', float('nan')):.3f}"
            f"  N {status.get('d3s/n', float('nan')):.0f}  K {status.get('d3s/k', float('nan')):.2f}"
            f"  kept rollouts {kept:.0f}/{status.get('rollout/num_samples', float('nan')):.0f}"
            f"  kept tokens {status.get('d3s/kept_tokens', float('nan')):.0f}"
            f"  ({status.get('timing/step_total', float('nan')):.1f}s)"
        )


def summarize(scalars, group_size, prompts_per_step):
    total = group_size * prompts_per_step
    steps = []
    for step, values in scalars.items():
        kept_rollouts = values.get("d3s/kept_rollouts", values.get("rollout/num_samples", total))
        steps.append(
            {
                "step": int(step),
                "reward": values["rollout/reward_mean"],
                "n": round(values.get("d3s/n", group_size)),
                "k": round(values.get("d3s/k", 1.0), 6),  # tensorboard stores float32
                "kept_rollouts": round(kept_rollouts),
                "kept_tokens": round(values["d3s/kept_tokens"]) if "d3s/kept_tokens" in values else None,
                "kept_rollout_frac": kept_rollouts / total,
                "kept_token_frac": values.get("d3s/kept_token_frac"),
                "policy_loss": values.get("policy_loss"),
                "grad_norm": values.get("actor_grad_norm"),
                "seconds": values.get("timing/step_total"),
            }
        )
    return steps


def heldout_summary(sft, rl):
    """The held-out figures of ``summary.json`` from :func:`evaluate.heldout_scores` of the SFT and the RL model
    (the same prompts): each metric's mean and 95% half-width per model, and the change with the paired interval
    (per-prompt differences) and its size in standard errors."""
    metrics = [key for key in sft if key != "entropy"]

    def figure(values):
        mean, half = evaluate.interval(values)
        return {"mean": mean, "ci95": half}

    change = {}
    for key in metrics:
        change[key] = figure(np.subtract(rl[key], sft[key]))
        se = change[key]["ci95"] / evaluate.Z_95
        change[key]["standard_errors"] = change[key]["mean"] / se if se > 0 else None
    return {
        "prompts": len(sft["greedy"]),
        "interval": "95%: mean +- 1.96 standard errors over the prompts; change: of the per-prompt differences",
        "sft": {**{key: figure(sft[key]) for key in metrics}, "entropy": sft.get("entropy")},
        "rl": {**{key: figure(rl[key]) for key in metrics}, "entropy": rl.get("entropy")},
        "change": change,
    }


def plot(steps, heldout, path, title, task):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    figure, reward_axis = plt.subplots(figsize=(7, 4.5))
    rewards = [s["reward"] for s in steps]
    reward_axis.plot(x, rewards, "o", markersize=3, color="tab:blue", alpha=0.4, label="rollout reward (task's reward)")
    window = [rewards[max(0, i - 4) : i + 1] for i in range(len(rewards))]
    reward_axis.plot(x, [sum(w) / len(w) for w in window], "-", color="tab:blue", label="reward, 5-step mean")
    # the SFT model before step 1, the RL model after the last step
    greedy = [heldout[model]["greedy"] for model in ("sft", "rl")]
    reward_axis.errorbar(
        [0, x[-1]],
        [g["mean"] for g in greedy],
        yerr=[g["ci95"] for g in greedy],
        fmt="D",
        color="tab:red",
        capsize=4,
        label=f"held-out greedy accuracy, before and after RL ({heldout['prompts']} prompts, 95% interval)",
    )
    reward_axis.set_xlabel("RL step")
    reward_axis.set_ylabel("mean reward / accuracy")
    reward_axis.set_ylim(0, 1.02)
    fraction_axis = reward_axis.twinx()
    fraction_axis.plot(x, [s["kept_rollout_frac"] for s in steps], "-", color="tab:orange", label="kept rollouts")
    if all(s["kept_token_frac"] is not None for s in steps):
        fraction_axis.plot(x, [s["kept_token_frac"] for s in steps], "-", color="tab:green", label="kept tokens")
    fraction_axis.set_ylabel("kept fraction")
    fraction_axis.set_ylim(0, 1.02)
    handles, labels = reward_axis.get_legend_handles_labels()
    lines = fraction_axis.get_lines()
    reward_axis.legend(
        handles + lines,
        labels + [line.get_label() for line in lines],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=2,
        fontsize=7,
        frameon=False,
    )
    reward_axis.set_title(f"{title} on {task} (CPU)", fontsize=10)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    out = os.path.abspath(options.out)
    os.makedirs(out, exist_ok=True)
    logs = os.path.join(out, "logs")
    progress = Progress()

    overrides = {"sft_epochs": options.sft_epochs, "n_prompts": options.prompts}
    task_config = pipeline.task_config(
        options.task, seed=options.seed, **{key: value for key, value in overrides.items() if value is not None}
    )
    progress.say(f"building tokenizer, model and task {options.task} in {out}; SFT warm start (log: {logs}/sft.log)")
    prepared = pipeline.prepare(
        out, task_config, log_path=os.path.join(logs, "sft.log"), on_line=progress.sft_line, fp32=True
    )
    rl_config = pipeline.demo_rl_config(task_config, options.episodes, d3s=not options.grpo_only, prepared=prepared)

    rl_dir = os.path.join(out, "rl")
    algorithm = "GRPO" if options.grpo_only else "GRPO + D3S"
    progress.say(
        f"RL: {algorithm} at lr {rl_config.lr:g}, {rl_config.steps * rl_config.episodes} steps (log: {logs}/rl.log)"
    )
    command = pipeline.launcher_command(
        pipeline.D3S_ENTRYPOINT, pipeline.ppo_args(prepared.sft_model, prepared.task, rl_dir, rl_config), rl_config.fp32
    )
    rc = pipeline.run_logged(command, os.path.join(logs, "rl.log"), on_line=progress.rl_line)
    if rc != 0:
        progress.say(f"RL failed (exit {rc}); see {logs}/rl.log")
        raise SystemExit(rc)

    from d3s_openrlhf.testbed.metrics import read_train_scalars

    steps = summarize(
        read_train_scalars(os.path.join(rl_dir, "tensorboard")),
        rl_config.samples_per_prompt,
        rl_config.prompts_per_step,
    )
    if not steps:
        raise SystemExit(f"no metrics were logged under {rl_dir}/tensorboard")
    progress.say("evaluating the SFT and the RL model on held-out problems")
    evaluation = dict(
        samples=EVAL_SAMPLES, seed=options.seed, task=options.task, max_new_tokens=prepared.max_new_tokens
    )
    heldout = heldout_summary(
        evaluate.heldout_scores(prepared.sft_model, prepared.task.heldout, **evaluation),
        evaluate.heldout_scores(os.path.join(rl_dir, "final_model"), prepared.task.heldout, **evaluation),
    )
    first, last = steps[:5], steps[-5:]
    summary = {
        "algorithm": algorithm,
        "task": options.task,
        "lr": rl_config.lr,
        "reward_before": sum(s["reward"] for s in first) / len(first),
        "reward_after": sum(s["reward"] for s in last) / len(last),
        "reward_definition": "mean task reward of the training rollouts (temperature 1, as logged by "
        "OpenRLHF): before = mean of the first 5 steps (step 1 samples the SFT model), after = mean of the last 5",
        "heldout": heldout,
        "steps": steps,
        "seconds": round(time.time() - progress.t0, 1),
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(steps, heldout, os.path.join(out, "progress.png"), algorithm, options.task)

    print()
    print(f"{'step':>4} {'reward':>7} {'N':>4} {'K':>5} {'kept rollouts':>14} {'kept tokens':>12}")
    for s in steps:
        tokens = "-" if s["kept_tokens"] is None else str(s["kept_tokens"])
        print(f"{s['step']:>4} {s['reward']:7.3f} {s['n']:4d} {s['k']:5.2f} {s['kept_rollouts']:>14} {tokens:>12}")
    print(
        f"\nreward (training rollouts, first 5 -> last 5 steps): {summary['reward_before']:.3f} ->"
        f" {summary['reward_after']:.3f}"
    )
    print(f"held-out accuracy, SFT -> RL model, on {heldout['prompts']} prompts (95% intervals):")
    names = {"greedy": "greedy", "sampled": "sampled (T=1)", f"pass@{EVAL_SAMPLES}": f"pass@{EVAL_SAMPLES}"}
    for key, name in names.items():
        sft, rl, change = heldout["sft"][key], heldout["rl"][key], heldout["change"][key]
        size = "" if change["standard_errors"] is None else f", {change['standard_errors']:.1f} standard errors"
        print(
            f"  {name:<14} {sft['mean']:.3f} +- {sft['ci95']:.3f} -> {rl['mean']:.3f} +- {rl['ci95']:.3f}"
            f"  (change {change['mean']:+.3f} +- {change['ci95']:.3f}{size})"
        )
    print(f"wrote {out}/summary.json and {out}/progress.png in {summary['seconds']:.0f}s")


if __name__ == "__main__":
    main()
