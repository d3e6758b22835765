"""Step cost of GRPO and D3S on the CPU runtime: experience making and actor update at several (N/G, K).

Run from the repository root (about 15 minutes on 2 cores):

    .venv/bin/python benchmarks/bench_step_cost.py [--out benchmarks/results] [--steps 5]

Every point is a real ``train_ppo_ray`` run through ``d3s_openrlhf.cli.train_ppo_ray`` under the CPU runtime
(vLLM CPU engine, DeepSpeed ZeRO-2, reference model for a KL penalty) of a randomly initialised 8-layer Llama
(~28M parameters) whose 4k-entry vocabulary makes EOS rare, so responses run to ``max_new_tokens``. The
reward is a fixed pseudo-random bit per response (``hash_reward.py``), so groups have reward variance. The
learning rate is 0: the policy, and with it the rollout distribution, is the same at every step of every run,
so all points time the same kind of rollouts (16 prompts x 8 rollouts of 64 tokens per step). Step 1 is
warm-up and is left out; each figure is the median over the remaining steps.

Writes ``OUT/step_cost.json`` (per point: the per-step timings and kept counts); ``benchmarks/report.py`` turns
it into the table and plot of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench_selection import cpu_model
from d3s_openrlhf.tasks import addition
from d3s_openrlhf.testbed import pipeline, toy
from d3s_openrlhf.testbed.metrics import read_train_scalars

HERE = Path(__file__).resolve().parent
GROUP = 8
PROMPTS = 16
MAX_NEW_TOKENS = 64
SHAPE = toy.ModelShape(
    hidden_size=512, num_layers=8, num_heads=8, head_dim=64, intermediate_size=1536, max_positions=128
)
FILLER_TOKENS = 4096
# (label, rollouts kept per prompt N, token fraction K); None = GRPO with D3S off
POINTS = (
    ("GRPO", None, None),
    ("N/G=1, K=0.2", 8, 0.2),
    ("N/G=1/2, K=1", 4, 1.0),
    ("N/G=1/2, K=0.2", 4, 0.2),
    ("N/G=1/4, K=1", 2, 1.0),
    ("N/G=1/4, K=0.2", 2, 0.2),
)
TIMINGS = ("timing/generation", "timing/make_experience", "timing/ppo_train", "timing/broadcast", "timing/step_total")


def d3s_flags(n, k):
    if n is None:
        return []
    # cross scope, a constant schedule: every step runs at this (N, K)
    return [
        *("--d3s.preset", "d3s"),
        *("--d3s.sample_scope", "cross"),
        *("--d3s.schedule", "constant"),
        *("--d3s.n_init", n),
        *("--d3s.n_final", n),
        *("--d3s.k_init", k),
        *("--d3s.k_final", k),
    ]


def write_inputs(workdir):
    model = toy.save_model_and_tokenizer(os.path.join(workdir, "model"), SHAPE, seed=0, filler_tokens=FILLER_TOKENS)
    # 512 RL prompts of the addition task with operands up to 49 (no SFT, no held-out split: the model is random)
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    rows = [{"input": addition.prompt_of(a, b), "label": str(a + b)} for a, b in addition.problems(49, 512, seed=0)]
    prompts = toy.write_jsonl(os.path.join(data, "prompts.jsonl"), rows)
    return model, pipeline.TaskFiles(sft="", prompts=prompts, heldout="")


def run_point(model, task, out_dir, n, k, steps, log):
    config = pipeline.RLConfig(
        prompts_per_step=PROMPTS,
        samples_per_prompt=GROUP,
        steps=steps,
        train_batch_size=32,
        micro_batch_size=16,
        lr=0.0,
        max_new_tokens=MAX_NEW_TOKENS,
        max_len=MAX_NEW_TOKENS + 16,
        reward=str(HERE / "hash_reward.py"),
        kl_coef=0.001,
        extra=d3s_flags(n, k),
    )
    args = pipeline.ppo_args(model, task, out_dir, config)
    rc = pipeline.run_logged(pipeline.launcher_command(pipeline.D3S_ENTRYPOINT, args), log, timeout=1200)
    if rc != 0:
        raise RuntimeError(f"run failed (exit {rc}); see {log}")
    return read_train_scalars(os.path.join(out_dir, "tensorboard"))


def summarize(label, n, k, scalars):
    measured = [values for step, values in scalars.items() if step > 1]
    total = PROMPTS * GROUP
    point = {
        "label": label,
        "n": n if n is not None else GROUP,
        "k": k if k is not None else 1.0,
        "per_step": {str(step): values for step, values in scalars.items()},
        "response_length_mean": statistics.mean(v["rollout/response_length_mean"] for v in measured),
    }
    for key in TIMINGS:
        point[key] = statistics.median(v[key] for v in measured)
    if n is None:
        point["kept_rollouts"] = total
        point["pg_tokens"] = statistics.mean(v["rollout/response_length_mean"] * total for v in measured)
        point["select_time_s"] = 0.0
    else:
        point["kept_rollouts"] = statistics.mean(v["d3s/kept_rollouts"] for v in measured)
        point["pg_tokens"] = statistics.mean(v["d3s/kept_tokens"] for v in measured)
        point["select_time_s"] = statistics.median(v["d3s/select_time_s"] for v in measured)
    return point


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="results directory")
    parser.add_argument("--workdir", default=None, help="scratch directory for runs (default: OUT/step_cost_runs)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run; step 1 is warm-up")
    options = parser.parse_args(argv)
    out = os.path.abspath(options.out)
    workdir = os.path.abspath(options.workdir or os.path.join(out, "step_cost_runs"))
    os.makedirs(workdir, exist_ok=True)
    model, task = write_inputs(workdir)

    points = []
    for index, (label, n, k) in enumerate(POINTS):
        started = time.time()
        run_dir = os.path.join(workdir, f"point{index}")
        scalars = run_point(model, task, run_dir, n, k, options.steps, os.path.join(workdir, f"point{index}.log"))
        points.append(summarize(label, n, k, scalars))
        print(
            f"{label:16s} make_experience {points[-1]['timing/make_experience']:6.2f}s  "
            f"ppo_train {points[-1]['timing/ppo_train']:6.2f}s  ({time.time() - started:.0f}s run)",
            flush=True,
        )
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "command": "benchmarks/bench_step_cost.py --steps " + str(options.steps),
        "model": {"shape": SHAPE.__dict__, "vocab": len(toy.SPECIAL_TOKENS) + len(addition.CHARACTERS) + FILLER_TOKENS},
        "prompts_per_step": PROMPTS,
        "group": GROUP,
        "max_new_tokens": MAX_NEW_TOKENS,
        "points": points,
    }
    with open(os.path.join(out, "step_cost.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
