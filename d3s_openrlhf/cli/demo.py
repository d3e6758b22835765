"""The built-in default job: the whole pipeline on a toy verifiable task, on CPU, in a few minutes.

    python -m d3s_openrlhf.cli.demo --out DIR

1. builds a character-level tokenizer and a 2-layer Llama locally (no hub) and an integer-addition task
   ("12+7=" -> "19") with an exact-match reward (``d3s_openrlhf/cpu/arith_reward.py``);
2. SFT warm start with OpenRLHF's ``openrlhf.cli.train_sft``;
3. RL with GRPO + D3S through ``d3s_openrlhf.cli.train_ppo_ray`` with OpenRLHF's vLLM engine: 16 prompts x
   16 rollouts per step, 3 passes over 400 prompts (75 steps), cross-group max-variance rollout selection and
   |A|*H token selection on a linear schedule N 4 -> 12 rollouts per prompt, K 30% -> 80% of tokens
   (``--grpo-only``: the same run without D3S). Both stages run under the CPU runtime
   (``python -m d3s_openrlhf.cli.cpu``);
4. reads the per-step metrics OpenRLHF logged (tensorboard), evaluates the SFT and the RL model on held-out
   problems, and writes ``DIR/summary.json`` and ``DIR/progress.png``.

Logs of every stage go to ``DIR/logs/``.
"""

import argparse
import ast
import json
import os
import re
import sys
import time

from d3s_openrlhf.cpu import pipeline

STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})\s*$")
SFT_EPOCH = re.compile(r"Train epoch:\s+\d+%.*?\|\s*(\d+)/(\d+)")


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m d3s_openrlhf.cli.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--episodes", type=int, default=3, help="passes over the 400 RL prompts, 25 steps each")
    parser.add_argument("--sft-epochs", type=int, default=pipeline.TaskConfig.sft_epochs)
    parser.add_argument("--grpo-only", action="store_true", help="RL without D3S (the baseline to compare with)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


PROMPTS_PER_STEP = 16
D3S_FLAGS = ["--d3s.preset", "d3s", "--d3s.n_init", 4, "--d3s.n_final", 12, "--d3s.k_init", 0.3, "--d3s.k_final", 0.8]


def demo_rl_config(task_config, episodes, d3s=True):
    """GRPO (+ D3S: N 4 -> 12 of 16 rollouts per prompt, K 30% -> 80% of tokens), 16 prompts x 16 rollouts a step."""
    return pipeline.RLConfig(
        prompts_per_step=PROMPTS_PER_STEP,
        samples_per_prompt=16,
        steps=task_config.n_prompts // PROMPTS_PER_STEP,
        episodes=episodes,
        train_batch_size=32,
        micro_batch_size=32,
        lr=2e-4,
        extra=D3S_FLAGS if d3s else [],
    )


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


def heldout_accuracy(model_path, heldout_path, samples=8, seed=0):
    """Exact-match accuracy on the held-out problems: greedy, and sampled at temperature 1 (as in training)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from d3s_openrlhf.cpu.arith_reward import answer_of

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with open(heldout_path) as f:
        rows = [json.loads(line) for line in f]
    prompts = [row["input"] for row in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    width = batch["input_ids"].shape[1]

    def accuracy(do_sample, repeats):
        torch.manual_seed(seed)
        inputs = {key: value.repeat(repeats, 1) for key, value in batch.items()}
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=4,
                do_sample=do_sample,
                temperature=1.0 if do_sample else None,
                top_k=0 if do_sample else None,
                top_p=1.0 if do_sample else None,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=False)
        labels = [row["label"] for row in rows] * repeats
        return sum(answer_of(text, "") == label for text, label in zip(texts, labels)) / len(texts)

    return {"greedy": accuracy(False, 1), "sampled": accuracy(True, samples)}


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


def plot(steps, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    figure, reward_axis = plt.subplots(figsize=(7, 4))
    rewards = [s["reward"] for s in steps]
    reward_axis.plot(x, rewards, "o", color="tab:blue", alpha=0.45, label="rollout reward (exact match)")
    window = [rewards[max(0, i - 4) : i + 1] for i in range(len(rewards))]
    reward_axis.plot(x, [sum(w) / len(w) for w in window], "-", color="tab:blue", label="reward, 5-step mean")
    reward_axis.set_xlabel("RL step")
    reward_axis.set_ylabel("mean reward")
    reward_axis.set_ylim(0, 1)
    fraction_axis = reward_axis.twinx()
    fraction_axis.plot(x, [s["kept_rollout_frac"] for s in steps], "s--", color="tab:orange", label="kept rollouts")
    if all(s["kept_token_frac"] is not None for s in steps):
        fraction_axis.plot(x, [s["kept_token_frac"] for s in steps], "^--", color="tab:green", label="kept tokens")
    fraction_axis.set_ylabel("kept fraction")
    fraction_axis.set_ylim(0, 1)
    lines = reward_axis.get_lines() + fraction_axis.get_lines()
    reward_axis.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=8)
    reward_axis.set_title(f"{title} on the toy addition task (CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    out = os.path.abspath(options.out)
    os.makedirs(out, exist_ok=True)
    logs = os.path.join(out, "logs")
    progress = Progress()

    task_config = pipeline.TaskConfig(sft_epochs=options.sft_epochs, seed=options.seed)
    rl_config = demo_rl_config(task_config, options.episodes, d3s=not options.grpo_only)
    progress.say(f"building tokenizer, model and task in {out}; SFT warm start (log: {logs}/sft.log)")
    prepared = pipeline.prepare(out, task_config, log_path=os.path.join(logs, "sft.log"), on_line=progress.sft_line)

    rl_dir = os.path.join(out, "rl")
    algorithm = "GRPO" if options.grpo_only else "GRPO + D3S"
    progress.say(f"RL: {algorithm}, {rl_config.steps * rl_config.episodes} steps (log: {logs}/rl.log)")
    command = pipeline.launcher_command(
        pipeline.D3S_ENTRYPOINT, pipeline.ppo_args(prepared.sft_model, prepared.task, rl_dir, rl_config)
    )
    rc = pipeline.run_logged(command, os.path.join(logs, "rl.log"), on_line=progress.rl_line)
    if rc != 0:
        progress.say(f"RL failed (exit {rc}); see {logs}/rl.log")
        raise SystemExit(rc)

    from d3s_openrlhf.cpu.metrics import read_train_scalars

    steps = summarize(
        read_train_scalars(os.path.join(rl_dir, "tensorboard")),
        rl_config.samples_per_prompt,
        rl_config.prompts_per_step,
    )
    if not steps:
        raise SystemExit(f"no metrics were logged under {rl_dir}/tensorboard")
    progress.say("evaluating the SFT and the RL model on held-out problems")
    heldout = {
        "sft": heldout_accuracy(prepared.sft_model, prepared.task.heldout, seed=options.seed),
        "rl": heldout_accuracy(os.path.join(rl_dir, "final_model"), prepared.task.heldout, seed=options.seed),
    }
    first, last = steps[:5], steps[-5:]
    summary = {
        "algorithm": algorithm,
        "reward_before": sum(s["reward"] for s in first) / len(first),
        "reward_after": sum(s["reward"] for s in last) / len(last),
        "reward_definition": "mean exact-match reward of the training rollouts (temperature 1, as logged by "
        "OpenRLHF): before = mean of the first 5 steps (step 1 samples the SFT model), after = mean of the last 5",
        "heldout_accuracy": heldout,
        "steps": steps,
        "seconds": round(time.time() - progress.t0, 1),
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(steps, os.path.join(out, "progress.png"), algorithm)

    print()
    print(f"{'step':>4} {'reward':>7} {'N':>4} {'K':>5} {'kept rollouts':>14} {'kept tokens':>12}")
    for s in steps:
        tokens = "-" if s["kept_tokens"] is None else str(s["kept_tokens"])
        print(f"{s['step']:>4} {s['reward']:7.3f} {s['n']:4d} {s['k']:5.2f} {s['kept_rollouts']:>14} {tokens:>12}")
    print(
        f"\nreward (training rollouts, first 5 -> last 5 steps): {summary['reward_before']:.3f} ->"
        f" {summary['reward_after']:.3f}"
        f"\nheld-out accuracy, greedy: {heldout['sft']['greedy']:.3f} -> {heldout['rl']['greedy']:.3f};"
        f" sampled (T=1): {heldout['sft']['sampled']:.3f} -> {heldout['rl']['sampled']:.3f}"
        f"\nwrote {out}/summary.json and {out}/progress.png in {summary['seconds']:.0f}s"
    )


if __name__ == "__main__":
    main()
