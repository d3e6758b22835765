"""The speed study: time to fixed held-out accuracies, each arm at its own tuned learning rate, as curves against
steps, wall time and generated tokens, over several seeds and two tasks.

Run from the repository root. One command runs the learning-rate sweep, then the study; each run is appended to
OUT/speed_study.json as it ends and the runs already there are skipped, so running the same command again resumes a
stopped invocation (a run cut off midway starts over):

    .venv/bin/python benchmarks/bench_speed.py [--out benchmarks/results]
        [--tasks d3s_openrlhf.tasks.chainsum d3s_openrlhf.tasks.chainsum_tens] [--regimes passes fresh]
        [--arms GRPO GRPO+DF PODS D3S D3S-I] [--lrs 2.5e-5 5e-5 1e-4 2e-4] [--sweep-seeds 0 1] [--seeds 2 3]
        [--phases sweep study rerun] [--rerun-seeds 0 1 2 3]
    .venv/bin/python benchmarks/bench_speed.py --quick --out /tmp/speed_quick   # the chain, in about 2 minutes
    .venv/bin/python benchmarks/report.py --speed OUT/speed_study.json --output OUT/speed_study.md  # the report alone

The protocol (the analysis: ``benchmarks/reporting/speed.py``):

- Arms (``bench_learning.PARTS["speed"]``): GRPO, GRPO + upstream's dynamic filtering, PODS (n = 16, m = 4,
  max-variance), D3S and D3S-I, all at G = 16 rollouts per prompt, 8 prompts a step. The generation level's arms
  (``GRPO+screen``, ``D3S+history``, ``D3S+screen4+history``, ``D3S+screen8+history``: pilots of 4 or 8, 2% of
  the screened-out prompts audited, a cost the clock counts; history acts only when prompts recur, so
  ``D3S+history`` runs in ``passes`` alone: in ``fresh`` it is D3S) are named with ``--arms``; their pilot, audit,
  skip and weight counts are kept per step. The report puts them in RESULTS.md section 6, beside GRPO and D3S (with
  the recorded runs of ``D3S+screen4+pilot-history``, whose flag ``--d3s.pilot_history`` was removed after the
  study), and the rest in section 11.
- Every run trains ``--steps`` (150) rollout steps with ``--d3s.schedule_steps`` (``bench_learning.rl_config``, as in
  the screen part), in the regimes ``passes`` (the first ``--pool`` 200 RL prompts, cycled: 6 passes) and ``fresh``
  (one pass over a 4000-prompt split). Per task, its regimes among ``--regimes`` are those of ``TASKS``: chainsum
  in both, chainsum_tens (the second task, on which chainsum's early saturation should not happen) in ``fresh``.
- Held-out greedy accuracy every ``--eval-every`` (10) steps on ``--heldout`` (256) prompts, from the checkpoints the
  run saves: after the run, in this process, with transformers' ``generate`` on the small model (no vLLM engine or
  Ray to start per checkpoint), greedy alone (``--eval-samples 0``: the study reads nothing else); the checkpoints
  are then deleted. Wall time is the sum of the steps' ``timing/step_total``: start-up, checkpoint saving and the
  evaluations are not in it.
- Per task, once its warm start (the task's SFT, shared by every run) is evaluated and before its first run, the
  thresholds: warm start + ``--fractions`` (25%, 50%, 75%) of the gap to 1.0, stored in the JSON and never
  recomputed. The workdir is scratch: on a fresh machine the warm start is made again, and the study goes on only if
  its weights are the recorded runs' (their digest; for a task recorded without one, only its held-out greedy
  accuracy is compared: chainsum's, made again on 2026-11-28, gave the recorded 111 of 256).
- The sweep: every arm at every ``--lrs`` (2.5e-5, 5e-5, 1e-4, 2e-4: today's 2e-4 and 8x below it; 2.5e-5 joined once
  most arms had chosen 5e-5, then the lowest rate; the committed chainsum_tens study ran ``--lrs 1.25e-5 2.5e-5 5e-5
  1e-4 2e-4``, as GRPO chose 2.5e-5 there), on the ``--sweep-seeds`` (0, 1), seed by seed. Each arm's rate is the one
  with the highest seed-mean area under its held-out curve against wall time up to the sweep's budget, GRPO's
  seed-mean total wall time at 2e-4. The study: the ``--seeds`` (2, 3) at each arm's chosen rate; the sweep's seeds at
  that rate count too, so 4 seeds. ``--phases study`` refuses to start an arm whose sweep is incomplete.
- ``--phases rerun`` times the ``--arms`` again at their chosen rates on ``--rerun-seeds``, recorded apart (phase
  ``rerun``, logs under ``WORKDIR/<task>/rerun``), once per arm and seed. The report shows the reruns of GRPO and D3S
  beside the generation level's arms of the same task and regime (section 6, as ``D3S rerun``; no part in the
  choice), which run in a later batch than the study: ``--arms D3S --phases rerun --rerun-seeds 0 1`` before them
  and ``2 3`` after (``--arms GRPO`` around GRPO + screening; 2026-11-27/28).

Cost on 2 CPU cores (measured 2026-11-27): a run with its 16 evaluations takes 2.5 to 4 minutes (chainsum; 3.3 on
average) and 3.5 to 3.7 (chainsum_tens), about 45 s of it starting Ray, the actors and vLLM; each task's SFT warm
start 5 minutes. Per task and regime, 5 arms x 4 rates x 2 seeds = 40 sweep runs and 5 x 2 = 10 study runs, about 2.8
hours; chainsum's two regimes and chainsum_tens's one make 150 runs (160 with chainsum_tens at 1.25e-5), about 8.5
hours. Leave the machine otherwise idle: the curves' clock is wall time (runs that shared the CPU with tests took
1.1-2.7x as long a step). Even idle, this VM's speed drifted between sessions: batches of runs generated 10-25% faster
or slower per token (2026-11-27), so runs added later (a new rate) carry that in their wall time; the report's steps
and generated-token ratios do not.

A run still going after ``--run-cap`` seconds (900) is stopped and kept with its logged steps and the checkpoints
it saved before its last one (``stopped`` in the JSON): GRPO + DF at 2e-4 on chainsum_tens collapsed to reward 0,
after which upstream's filter drops every group (all flat) and draws again, so a step that needs 8 groups with
variance generates for ever (2026-11-27). Such a run's last evaluation is its final accuracy (a collapse, read as
any other) and a threshold it never reached is censored at its end; the report lists the stopped runs.

``--quick`` checks the chain: a 1-epoch SFT on 64 examples, GRPO and D3S (the arms that drop flat groups would stall on
so weak a warm start), lr 2e-4, seed 0, 4 steps with an evaluation every 2 on 16 held-out prompts, then the report,
which says it is a smoke test (``--regimes fresh``, 2026-11-27, 2 CPU cores: 2 minutes; the SFT 21 s, each run 48 s,
nearly all of it starting Ray, the actors and vLLM). One ``--out`` holds one protocol: a run with other settings is
refused. Every invocation ends with the report on the results so far (``OUT/speed_study.md`` and its plots);
``benchmarks/report.py`` puts it in RESULTS.md as sections 11 and 6 (the generation level's arms).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np

import bench_learning
from bench_learning import FRESH_PROMPTS, PARTS, PASSES_PROMPTS, PROMPTS, REGIMES, SCREEN_STEPS
from bench_selection import cpu_model
from d3s_openrlhf.testbed import evaluate, pipeline
from reporting.generation_study import generated_tokens
from reporting.speed import REFERENCE_LR, regime_analysis, thresholds

HERE = Path(__file__).resolve().parent
RESULTS_FILE = "speed_study.json"
TASKS = {"d3s_openrlhf.tasks.chainsum": REGIMES, "d3s_openrlhf.tasks.chainsum_tens": ("fresh",)}  # task -> regimes
ARMS = ("GRPO", "GRPO+DF", "PODS", "D3S", "D3S-I")
QUICK_ARMS = ("GRPO", "D3S")  # the quick warm start solves almost nothing: the arms that drop flat groups would stall
LRS = (2.5e-5, 5e-5, 1e-4, REFERENCE_LR)
SWEEP_SEEDS, STUDY_SEEDS = (0, 1), (2, 3)
EVAL_EVERY, HELDOUT = 10, 256
FRACTIONS = (0.25, 0.5, 0.75)  # thresholds: warm start + these shares of the gap to 1.0
STEP_KEYS = (
    "timing/step_total",
    "timing/generation",
    "timing/make_experience",
    "timing/ppo_train",
    "timing/broadcast",
    "rollout/reward_mean",
)
# the generation level's counts, kept for the arms that log them (issue 39: acceptance, false rejects, staleness)
GENERATION_KEYS = (
    "d3s/pilots",
    "d3s/screened_prompts",
    "d3s/carried_pilots",
    "d3s/audited_prompts",
    "d3s/false_rejects",
    "d3s/skipped_prompts",
    "d3s/skip_candidates",
    "d3s/screen_weight_mean",
    "dynamic_filtering_pass_rate",
)
RUN_CAP = 900.0  # seconds; a run takes 2.5 to 4 minutes (2026-11-27)
PROTOCOL = (
    "precision",
    "quick",
    "steps",
    "eval_every",
    "prompts_per_step",
    "pool",
    "heldout",
    "eval_samples",
    "fractions",
)


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="results directory")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: OUT/speed_runs)")
    parser.add_argument(
        "--tasks", nargs="+", default=None, help=f"task modules (default: {' '.join(TASKS)}; --quick: chainsum)"
    )
    parser.add_argument(
        "--regimes", nargs="+", default=list(REGIMES), choices=REGIMES, help="among each task's own (TASKS)"
    )
    parser.add_argument("--arms", nargs="+", default=None, choices=list(PARTS["speed"]), help=f"default: {ARMS}")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="the sweep's learning rates")
    parser.add_argument("--sweep-seeds", type=int, nargs="+", default=list(SWEEP_SEEDS))
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=list(STUDY_SEEDS), help="the study's other seeds, at the chosen rates"
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        default=["sweep", "study"],
        choices=("sweep", "study", "rerun"),
        help="rerun: the --arms again at their chosen rates on --rerun-seeds, kept apart (phase rerun), so that the "
        "generation level's arms, run in a later batch, are compared with GRPO and D3S timed in the same batch",
    )
    parser.add_argument("--rerun-seeds", type=int, nargs="+", default=[*SWEEP_SEEDS, *STUDY_SEEDS])
    parser.add_argument("--steps", type=int, default=SCREEN_STEPS, help="rollout steps per run")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument("--heldout", type=int, default=HELDOUT, help="held-out prompts")
    parser.add_argument("--eval-samples", type=int, default=0, help="sampled responses per held-out prompt (0: none)")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per RL step")
    parser.add_argument("--pool", type=int, default=PASSES_PROMPTS, help="the passes regime's RL prompts")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS), help="the thresholds' shares")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--quick", action="store_true", help="check the chain (see the docstring)")
    parser.add_argument(
        "--run-cap",
        type=float,
        default=RUN_CAP,
        help="seconds after which a run is stopped and kept with the evaluations it saved (a collapsed policy under "
        "dynamic filtering can generate flat groups for hours)",
    )
    parser.add_argument("--no-report", action="store_true")
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.eval_every, options.heldout, options.pool = 4, 2, 16, 2 * options.prompts
        options.lrs, options.sweep_seeds, options.seeds, options.rerun_seeds = [REFERENCE_LR], [0], [], [0]
    options.tasks = options.tasks or (["d3s_openrlhf.tasks.chainsum"] if options.quick else list(TASKS))
    options.arms = options.arms or list(QUICK_ARMS if options.quick else ARMS)
    if not any(math.isclose(lr, REFERENCE_LR) for lr in options.lrs):
        raise SystemExit(f"--lrs must include {REFERENCE_LR:g}: GRPO's total wall time at it is the sweep's budget")
    if set(options.seeds) & set(options.sweep_seeds):
        raise SystemExit(f"--seeds {options.seeds} and --sweep-seeds {options.sweep_seeds} must differ")
    if not all(0 < f < 1 for f in options.fractions):
        raise SystemExit(f"--fractions {options.fractions} must lie between 0 and 1")
    if "passes" in options.regimes:
        bench_learning.check_pool(options.pool, options.prompts, options.steps)
    return options


def task_overrides(options):
    """The task config's sizes: a fresh split large enough never to cycle, the held-out prompts; --quick's SFT."""
    if options.quick:
        return dict(n_sft=64, sft_epochs=1, n_prompts=4 * options.steps * options.prompts, n_heldout=options.heldout)
    return dict(n_prompts=FRESH_PROMPTS, n_heldout=options.heldout)


def protocol(options):
    """The settings every run of one --out shares (``PROTOCOL``)."""
    values = dict(vars(options), prompts_per_step=options.prompts, fractions=list(options.fractions))
    return {key: values[key] for key in PROTOCOL}


def open_document(options, path):
    """The study so far in ``path``, refused if it was run with another protocol (one --out holds one study)."""
    document = bench_learning.load(path) or {"protocol": protocol(options), "tasks": {}, "runs": []}
    mine = protocol(options)
    for key in PROTOCOL:
        if document["protocol"][key] != mine[key]:
            raise SystemExit(f"{path} holds a study with {key} {document['protocol'][key]}; give another --out")
    return document


def save(document, path):
    Path(path).write_text(json.dumps(document, indent=1))


def weights_digest(model_dir):
    """sha256 of a model's safetensors files: the warm start's identity, whichever machine or workdir made it."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model_dir} holds no *.safetensors: not a warm start bench_speed.py can identify")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def prepare(options, task, document, workdir, path):
    """The task's warm start (its SFT, made once per task config in ``workdir``) and, before the task's first run,
    its held-out greedy accuracy and thresholds in ``document``. Once runs are recorded the warm start is theirs: one
    found in ``workdir`` or made there anew (a fresh machine) is taken only with the same weights, or, for a task
    recorded before their digest was kept, the same held-out greedy accuracy (the digest is then kept)."""
    config = pipeline.task_config(task, **task_overrides(options))
    if options.steps * options.prompts > config.n_prompts:  # the fresh regime's one pass
        raise SystemExit(f"--steps {options.steps} x --prompts {options.prompts} exceed {config.n_prompts} RL prompts")
    split = f"-sft{config.n_sft}x{config.sft_epochs}-prompts{config.n_prompts}-heldout{config.n_heldout}"
    recorded = any(run["task"] == task for run in document["runs"])
    prepared, sft_seconds = bench_learning.prepare_task(task, options.precision, config, workdir, split)
    digest = weights_digest(prepared.sft_model)
    entry = document["tasks"].get(task)
    if not recorded:  # a warm start other than the entry's, if any, replaces it: no run reads its thresholds yet
        if entry is None or sft_seconds is not None or entry.get("sft_digest") != digest:
            entry = document["tasks"][task] = dict(
                task_config=dataclasses.asdict(config),
                warm_start=warm_start_accuracy(options, task, prepared),
                sft_seconds=sft_seconds,
                date=time.strftime("%Y-%m-%d"),
            )
            entry["thresholds"] = thresholds(entry["warm_start"]["greedy"], options.fractions)
            print(f"{task}: warm start held-out greedy {entry['warm_start']['greedy']:.3f}", flush=True)
    elif entry is None:
        raise SystemExit(f"{path} holds runs of {task} but not their warm start and thresholds: give another --out")
    else:
        reproduced = (
            entry["sft_digest"] == digest
            if "sft_digest" in entry
            else warm_start_accuracy(options, task, prepared) == entry["warm_start"]
        )
        if not reproduced:
            raise SystemExit(
                f"{path} holds runs of {task} from another warm start than the one in {workdir} (found there or made "
                "there anew, its weights or held-out accuracy differ): give the --workdir of those runs, or another "
                "--out"
            )
        if sft_seconds is not None:  # made again: its time counts in the study's duration
            entry.setdefault("sft_remade", []).append(dict(date=time.strftime("%Y-%m-%d"), sft_seconds=sft_seconds))
    entry["sft_digest"] = digest
    save(document, path)
    return prepared


def warm_start_accuracy(options, task, prepared):
    return evaluate.heldout_accuracy(
        prepared.sft_model,
        prepared.task.heldout,
        seed=0,
        task=task,
        max_new_tokens=prepared.max_new_tokens,
        samples=options.eval_samples,
    )


def recorded(document, task, regime, arm, lr, seed, rerun=False):
    """Whether the run (a rerun, with ``rerun``) is in ``document``."""
    return any(
        (run["task"], run["regime"], run["arm"], run["seed"]) == (task, regime, arm, seed)
        and math.isclose(run["lr"], lr, rel_tol=1e-9)
        and (run["phase"] == "rerun") == rerun
        for run in document["runs"]
    )


def record(result, task, regime, arm, lr, seed, phase, warm_start):
    """One run as the JSON keeps it: its settings, durations, the held-out curve with its three clocks (the warm
    start first, at step 0) and the per-step timings as columns."""
    steps = result["steps"]
    wall = np.cumsum([s["timing/step_total"] for s in steps])
    generated = np.cumsum([generated_tokens(s) for s in steps])
    curve = [dict(step=0, wall=0.0, generated=0.0, greedy=warm_start)] + [
        {**e, "wall": float(wall[e["step"] - 1]), "generated": float(generated[e["step"] - 1])}
        for e in result["heldout"]
    ]
    return dict(
        task=task,
        regime=regime,
        arm=arm,
        lr=lr,
        seed=seed,
        phase=phase,
        date=time.strftime("%Y-%m-%d"),
        machine=f"{cpu_model()}, {os.cpu_count()} CPUs",
        group=result["group"],
        flags=[str(flag) for flag in PARTS["speed"][arm][1]],
        process_seconds=result["process_seconds"],
        eval_seconds=result["eval_seconds"],
        stopped=result["stopped"],
        curve=curve,
        steps={
            **{key: [s[key] for s in steps] for key in STEP_KEYS},
            **{key: [s.get(key, 0.0) for s in steps] for key in GENERATION_KEYS if any(key in s for s in steps)},
            "generated": [float(g) for g in generated],
        },
    )


def run_one(options, prepared, document, path, workdir, key, phase):
    """Run ``key`` = (task, regime, arm, lr, seed) unless it is recorded; append it to ``document`` and save."""
    task, regime, arm, lr, seed = key
    if recorded(document, *key, rerun=phase == "rerun"):
        return
    n_prompts = document["tasks"][task]["task_config"]["n_prompts"]
    result = bench_learning.run(
        prepared[task],
        task,
        "speed",
        arm,
        seed,
        os.path.join(workdir, bench_learning.task_dir_name(task), *(["rerun"] if phase == "rerun" else [])),
        options.steps,
        options.eval_every,
        options.eval_samples,
        options.prompts,
        options.precision == "fp32",
        regime=regime,
        pool=options.pool if regime == "passes" else n_prompts,
        lr=lr,
        keep_models=False,
        cap=options.run_cap,
    )
    warm_start = document["tasks"][task]["warm_start"]["greedy"]
    entry = record(result, task, regime, arm, lr, seed, phase, warm_start)
    document["runs"].append(entry)
    save(document, path)
    stopped = (
        f" (stopped at the {options.run_cap:.0f} s cap after step {len(result['steps'])})" if entry["stopped"] else ""
    )
    print(
        f"{task} {regime} {arm} lr {lr:g} seed {seed} ({phase}): held-out greedy {entry['curve'][-1]['greedy']:.3f}"
        f"{stopped}; run {result['process_seconds']:.0f}s + eval {result['eval_seconds']:.0f}s",
        flush=True,
    )


def regimes_of(options, task):
    return [regime for regime in options.regimes if regime in TASKS.get(task, REGIMES)]


def chosen_lr(options, document, task, regime, arm):
    """The arm's rate from its complete sweep (every --lrs on every --sweep-seeds, and GRPO at the reference rate
    for the budget); refused while a run of it is missing."""
    needed = [(arm, lr) for lr in options.lrs] + [("GRPO", REFERENCE_LR)]
    missing = [
        f"{a} lr {lr:g} seed {seed}"
        for a, lr in needed
        for seed in options.sweep_seeds
        if not recorded(document, task, regime, a, lr, seed)
    ]
    analysed = regime_analysis(document, task, regime)
    # the report's rule: every (lr, seed) that any arm of this task and regime swept (an earlier --lrs included)
    missing += [f"{arm} lr {lr:g} seed {seed}" for lr, seed in analysed["incomplete"].get(arm, ())]
    if missing:
        raise SystemExit(
            f"the study of {arm} ({task}, {regime}) needs its sweep first (--phases sweep); missing: "
            + ", ".join(dict.fromkeys(missing))
        )
    return analysed["chosen"][arm]


def main(argv=None):
    options = parse_options(argv)
    out = os.path.abspath(options.out)
    workdir = os.path.abspath(options.workdir or os.path.join(out, "speed_runs"))
    path = os.path.join(out, RESULTS_FILE)
    document = open_document(options, path)
    for directory in (out, workdir):
        os.makedirs(directory, exist_ok=True)
    started = time.time()
    prepared = {task: prepare(options, task, document, workdir, path) for task in options.tasks}
    cells = [
        (task, regime, arm) for task in options.tasks for regime in regimes_of(options, task) for arm in options.arms
    ]
    if "sweep" in options.phases:  # seed-major: a drift of the machine's speed hits every arm and rate alike
        for seed in options.sweep_seeds:
            for task, regime, arm in cells:
                for lr in options.lrs:
                    run_one(options, prepared, document, path, workdir, (task, regime, arm, lr, seed), "sweep")
    if "study" in options.phases:
        for seed in options.seeds:
            for task, regime, arm in cells:
                lr = chosen_lr(options, document, task, regime, arm)
                run_one(options, prepared, document, path, workdir, (task, regime, arm, lr, seed), "study")
    if "rerun" in options.phases:
        for seed in options.rerun_seeds:
            for task, regime, arm in cells:
                lr = chosen_lr(options, document, task, regime, arm)
                run_one(options, prepared, document, path, workdir, (task, regime, arm, lr, seed), "rerun")
    print(f"wrote {path} ({time.time() - started:.0f}s)")
    if not options.no_report:
        from reporting.speed_doc import speed_main

        speed_main(path, os.path.join(out, "speed_study.md"))
    return path


if __name__ == "__main__":
    main()
