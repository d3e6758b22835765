"""Learning efficiency on the built-in task: GRPO, PODS, D3S (cross) and D3S-I, several seeds, same rollouts.

Run from the repository root (about 20 minutes on 2 cores for 4 methods x 3 seeds):

    .venv/bin/python benchmarks/bench_learning.py [--out benchmarks/results] [--seeds 0 1 2]

One SFT warm start of the demo's toy model (``d3s_openrlhf.cli.demo``) is shared by every run. Every run is
the demo's RL job (16 prompts x 16 rollouts per step, 75 steps, lr 2e-4, train batch 32) through
``d3s_openrlhf.cli.train_ppo_ray`` with ``--train.seed SEED``; the methods differ only in their ``--d3s.*``
flags, so every method generates the same number of rollouts per step (the same rollout budget):

- GRPO: D3S off, trains on all 256 rollouts;
- PODS: ``--d3s.preset pods``, m = 4 of n = 16 rollouts per prompt (PODS's m/n = 1/4), advantages over the
  kept subset;
- D3S: cross-group selection and |A|*H token selection, N 4 -> 12 of 16, K 0.3 -> 0.8, linear (the demo's
  schedule; the paper's K 5% -> 20% is meant for long chain-of-thought responses, ours have <= 4 tokens);
- D3S-I: the same with intra-group selection.

Per step it keeps what OpenRLHF logged (reward of all generated rollouts, kept rollouts and tokens, the actor
gradient norm, step timings); after each run it measures held-out exact-match accuracy (greedy and sampled at
T=1) of the final model. Writes ``OUT/learning.json``; ``benchmarks/report.py`` makes the plots and tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from bench_selection import cpu_model

from d3s_openrlhf.cli import demo
from d3s_openrlhf.cpu import pipeline
from d3s_openrlhf.cpu.metrics import read_train_scalars

HERE = Path(__file__).resolve().parent
METHODS = {
    "GRPO": [],
    "PODS": ["--d3s.preset", "pods", "--d3s.n_init", 4, "--d3s.n_final", 4],
    "D3S": demo.D3S_FLAGS,
    "D3S-I": ["--d3s.preset", "d3s-i", *demo.D3S_FLAGS[2:]],
}
KEYS = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "rollout/num_samples",
    "actor_grad_norm",
    "policy_loss",
    "d3s/kept_rollouts",
    "d3s/kept_tokens",
    "d3s/select_time_s",
    "timing/generation",
    "timing/make_experience",
    "timing/ppo_train",
    "timing/broadcast",
    "timing/step_total",
)


def run(prepared, method, seed, workdir, episodes):
    task_config = pipeline.TaskConfig()
    config = dataclasses.replace(demo.demo_rl_config(task_config, episodes), extra=list(METHODS[method]), seed=seed)
    run_dir = os.path.join(workdir, f"{method}-seed{seed}")
    command = pipeline.launcher_command(
        pipeline.D3S_ENTRYPOINT, pipeline.ppo_args(prepared.sft_model, prepared.task, run_dir, config)
    )
    log = os.path.join(workdir, f"{method}-seed{seed}.log")
    started = time.time()
    rc = pipeline.run_logged(command, log, timeout=1800)
    if rc != 0:
        raise RuntimeError(f"{method} seed {seed} failed (exit {rc}); see {log}")
    seconds = time.time() - started
    scalars = read_train_scalars(os.path.join(run_dir, "tensorboard"))
    steps = [{"step": step, **{key: values[key] for key in KEYS if key in values}} for step, values in scalars.items()]
    heldout = demo.heldout_accuracy(os.path.join(run_dir, "final_model"), prepared.task.heldout, seed=seed)
    return {"steps": steps, "heldout": heldout, "process_seconds": seconds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="results directory")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: OUT/learning_runs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--episodes", type=int, default=3, help="passes over the 400 prompts, 25 steps each")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    options = parser.parse_args(argv)
    out = os.path.abspath(options.out)
    workdir = os.path.abspath(options.workdir or os.path.join(out, "learning_runs"))
    os.makedirs(workdir, exist_ok=True)

    prepared = pipeline.prepare(os.path.join(workdir, "toy"), log_path=os.path.join(workdir, "sft.log"))
    results = {}
    for seed in options.seeds:  # seed-major: a drift of the machine's speed hits every method alike
        for method in options.methods:
            result = run(prepared, method, seed, workdir, options.episodes)
            results.setdefault(method, {})[str(seed)] = result
            last = result["steps"][-10:]
            print(
                f"{method:6s} seed {seed}: reward (last 10 steps) "
                f"{sum(s['rollout/reward_mean'] for s in last) / len(last):.3f}, held-out greedy "
                f"{result['heldout']['greedy']:.3f}, {result['process_seconds']:.0f}s",
                flush=True,
            )
    document = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "command": "benchmarks/bench_learning.py --seeds " + " ".join(map(str, options.seeds)),
        "methods": {method: [str(flag) for flag in METHODS[method]] for method in options.methods},
        "sft_heldout": demo.heldout_accuracy(prepared.sft_model, prepared.task.heldout, seed=0),
        "results": results,
    }
    with open(os.path.join(out, "learning.json"), "w") as f:
        json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
