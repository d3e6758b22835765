"""Learning-efficiency study: PODS as published and the D3S family, several seeds, on a task module.

Run from the repository root (parts and methods can run alone; each run appends to OUT/learning_study.json):

    .venv/bin/python benchmarks/bench_learning.py [--task d3s_openrlhf.tasks.chainsum] [--parts pods d3s]
        [--methods ...] [--seeds 0 1 2] [--steps 100] [--precision fp32] [--out benchmarks/results]
    .venv/bin/python benchmarks/bench_learning.py --quick --out /tmp/quick   # the whole chain in 11 minutes
    .venv/bin/python benchmarks/bench_learning.py --parts screen [--regimes passes fresh] [--seeds 0 1 2]
        # the generation level's first study: OUT/generation_study.json, section 12 of RESULTS.md

One SFT warm start per task and seed 0 (``pipeline.prepare``: tokenizer, 2-layer Llama, SFT, reward file from the
task module) is shared by every run. Every run is ``d3s_openrlhf.cli.train_ppo_ray`` on the CPU runtime with
``--train.seed SEED``, ``PROMPTS`` prompts per step, lr 2e-4, train batch 32; the methods differ only in the
rollouts generated per prompt and their ``--d3s.*`` flags. SFT and RL run in float32 (the CPU launcher's
``--fp32``; ``--precision bf16`` for upstream's bf16, which CPUs without native bf16 emulate about 9x slower).
Three parts:

- ``pods`` (PODS as published, n = 4m): GRPO generating and training n = m = 4 rollouts per prompt, against PODS
  generating n = 16 and training m = 4 (advantages over the kept subset) with each of PODS's rules: max-variance
  (PODS), random and max-reward (its rule ablation). Every method trains the same 4 rollouts per prompt.
- ``d3s`` (the D3S family at equal G = 16 generated rollouts per prompt): GRPO (trains all 16), D1S (intra-group
  max-variance, fixed N = 8), D1S-Cross (cross-group, N = 8), D2S (D1S-Cross + tokens, fixed K = 0.35), D3S
  (cross-group, linear N 4 -> 12 and K 0.2 -> 0.5) and D3S-I (D3S with intra-group selection). D2S against D3S
  isolates the schedule: the same mean N and K. K is scaled to our responses (20-44 tokens, a few of which
  decide correctness), not the paper's 5% -> 20% of long chains of thought.

- ``screen`` (the generation level at fixed steps, run alone: ``generation_study.json``): GRPO, GRPO + upstream's
  dynamic filtering (GRESO's baseline), GRPO + screening (pilots of k = 4 of G = 16), D3S, and D3S + screening + the
  history prior. Every arm trains the same ``--steps`` (150) rollout steps: the arms that drop prompts by
  ``--d3s.schedule_steps``, cycling over the data as they need, the others by whole passes. Two regimes: ``passes``
  (the first ``--pool`` 200 prompts, 6 passes) and ``fresh`` (a 4000-prompt split, one pass). The screening arms
  complete 10% of their screened-out prompts (``--d3s.pilot_audit``) to count false rejects. Cost on 2 CPU cores
  (2026-11-25/26): its own SFT warm start 5 to 19 minutes (the longer under load), then 27 to 33 minutes a seed.

The speed study (``benchmarks/bench_speed.py``) launches its runs through :func:`run` too: its arms are
``PARTS["speed"]``, at the screen part's fixed steps and regimes, each at the learning rate its sweep chose.

GRPO runs as ``--d3s.preset d1s`` with N = G (nothing dropped: upstream's batch path, the same update as D3S off)
so that it logs the share of zero-variance groups like the other methods.

Per step it keeps what OpenRLHF logged (reward, kept rollouts and tokens, zero-variance groups, the actor gradient
norm, step timings). Every ``--eval-every`` steps the run saves the actor (``--ckpt.save_hf``); after the run
each checkpoint and the final model are evaluated on the held-out split: greedy and sampled (T = 1) accuracy
and the policy's mean per-token entropy over its sampled responses. ``benchmarks/report.py --study`` turns
``learning_study.json`` into tables, tests and plots.

Cost on 2 CPU cores (AMD EPYC, fp32, 2026-11-25), at the defaults (3 seeds x 100 steps): the SFT 3.7 minutes, the
``pods`` part 24 minutes, the ``d3s`` part 44, in all 72. A run spends about 43 s outside its steps (starting Ray,
the actors and the vLLM engine, checkpoints, shutdown), then steps of 0.49 s (GRPO at n = 4) to 1.19 s (GRPO at
G = 16), about half of it generating; held-out evaluations take seconds. (The first run, on 2026-11-24, took 124
minutes: before the runtime set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and on a slower machine.)

``--quick`` smoke-tests the whole chain (a 1-epoch SFT on 64 examples, every method for 1 seed x 3 steps, the
evaluations, the report) in 11 minutes on 2 CPU cores (2026-11-25: the SFT 2.3, then ten real Ray runs of 44-53 s,
nearly all of it starting Ray, the actors and vLLM; ``--parts`` and ``--methods`` narrow it). Its report says it is a
smoke test, and one ``--out`` holds either a quick run or a study. Every invocation ends with the report on the results
so far: ``report.py --study`` (``OUT/learning_study.md`` and ``.png``), or for the screen part
``OUT/generation_study.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import time
from pathlib import Path

from bench_selection import cpu_model
from d3s_openrlhf.testbed import evaluate, pipeline
from d3s_openrlhf.testbed.metrics import read_train_scalars

HERE = Path(__file__).resolve().parent
DEFAULT_TASK = "d3s_openrlhf.tasks.chainsum"
PROMPTS = 8  # prompts per step


def _n(n_init, n_final=None):
    return ["--d3s.n_init", n_init, "--d3s.n_final", n_init if n_final is None else n_final]


PODS_M, PODS_N = 4, 16  # PODS's n = 4m (the paper's GSM8K setting is m = 16, n = 64)
G = 16  # the D3S family's generated rollouts per prompt
# method -> (generated rollouts per prompt, --d3s.* flags)
PARTS = {
    "pods": {
        "GRPO": (PODS_M, ["--d3s.preset", "d1s", *_n(PODS_M)]),
        "PODS": (PODS_N, ["--d3s.preset", "pods", *_n(PODS_M)]),
        "PODS-random": (PODS_N, ["--d3s.preset", "pods", "--d3s.sample_rule", "random", *_n(PODS_M)]),
        "PODS-max-reward": (PODS_N, ["--d3s.preset", "pods", "--d3s.sample_rule", "max_reward", *_n(PODS_M)]),
    },
    "d3s": {
        "GRPO": (G, ["--d3s.preset", "d1s", *_n(G)]),
        "D1S": (G, ["--d3s.preset", "d1s", *_n(8)]),
        "D1S-Cross": (G, ["--d3s.preset", "d1s-cross", *_n(8)]),
        "D2S": (G, ["--d3s.preset", "d2s", *_n(8), "--d3s.k_init", 0.35, "--d3s.k_final", 0.35]),
        "D3S": (G, ["--d3s.preset", "d3s", *_n(4, 12), "--d3s.k_init", 0.2, "--d3s.k_final", 0.5]),
        "D3S-I": (G, ["--d3s.preset", "d3s-i", *_n(4, 12), "--d3s.k_init", 0.2, "--d3s.k_final", 0.5]),
    },
}
# the screen part: the generation level at fixed steps, every arm training SCREEN_STEPS rollout steps
SCREEN_STEPS = 150
PILOT = 4  # pilot rollouts of k of G = 16 (Pilot-Commit pilots a quarter of its group)
AUDIT = 0.1  # share of the screened-out prompts completed to count false rejects (--d3s.pilot_audit)
PASSES_PROMPTS = 200  # the "passes" regime's RL prompts, cycled (6 passes at 150 steps of 8)
FRESH_PROMPTS = 4000  # the screen part's RL split: the "fresh" regime draws from it without cycling
REGIMES = ("passes", "fresh")
DYNAMIC_FILTERING = ["--algo.dynamic_filtering_enable"]  # upstream's range (0, 1): drops flat 0/1 groups
SCREEN = ["--d3s.pilot_rollouts", PILOT, "--d3s.pilot_audit", AUDIT]
HISTORY = ["--d3s.prompt_skip", "history"]
PARTS["screen"] = {
    "GRPO": PARTS["d3s"]["GRPO"],
    "GRPO+DF": (G, PARTS["d3s"]["GRPO"][1] + DYNAMIC_FILTERING),
    "GRPO+screen": (G, PARTS["d3s"]["GRPO"][1] + SCREEN),
    "D3S": PARTS["d3s"]["D3S"],
    "D3S+screen+history": (G, PARTS["d3s"]["D3S"][1] + SCREEN + HISTORY),
}
# the speed study's arms (benchmarks/bench_speed.py, run there alone): the papers' arms at G = 16, each at its tuned
# rate, at the screen part's fixed steps; PODS trains m = 4 of its n = 16. Then the generation level's arms: GRPO +
# screening, D3S + history, D3S + screening at k = 4 and 8, each with history. Their audits cost generation that the
# clock counts, so they complete 2% of the screened-out prompts, not the screen part's 10%.
SPEED_AUDIT = 0.02


def _screen(pilots):
    return ["--d3s.pilot_rollouts", pilots, "--d3s.pilot_audit", SPEED_AUDIT]


PARTS["speed"] = {
    "GRPO": PARTS["screen"]["GRPO"],
    "GRPO+DF": PARTS["screen"]["GRPO+DF"],
    "PODS": PARTS["pods"]["PODS"],
    "D3S": PARTS["d3s"]["D3S"],
    "D3S-I": PARTS["d3s"]["D3S-I"],
    "GRPO+screen": (G, PARTS["d3s"]["GRPO"][1] + _screen(PILOT)),
    "D3S+history": (G, PARTS["d3s"]["D3S"][1] + HISTORY),
    "D3S+screen4+history": (G, PARTS["d3s"]["D3S"][1] + _screen(4) + HISTORY),
    "D3S+screen8+history": (G, PARTS["d3s"]["D3S"][1] + _screen(8) + HISTORY),
}
FIXED_STEP_PARTS = ("screen", "speed")  # every arm trains the same --steps, in the regimes passes and fresh
RESULTS_FILES = {"pods": "learning_study.json", "d3s": "learning_study.json", "screen": "generation_study.json"}
KEYS = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "rollout/num_samples",
    "actor_grad_norm",
    "policy_loss",
    "d3s/kept_rollouts",
    "d3s/kept_tokens",
    "d3s/candidate_tokens",
    "d3s/zero_var_groups",
    "d3s/entropy_all",
    "d3s/select_time_s",
    "d3s/skipped_prompts",
    "d3s/skip_candidates",
    "d3s/pilots",
    "d3s/screened_prompts",
    "d3s/carried_pilots",
    "d3s/audited_prompts",
    "d3s/false_rejects",
    "d3s/screen_weight_mean",
    "d3s/passes",
    "d3s/generated_tokens",
    "dynamic_filtering_pass_rate",
    "timing/generation",
    "timing/make_experience",
    "timing/ppo_train",
    "timing/broadcast",
    "timing/step_total",
)
CHECKPOINT = re.compile(r"global_step(\d+)_hf$")


def drops_prompts(part, method):
    """Whether the arm drops prompts before training (screening, skipping, dynamic filtering): it then trains the
    fixed --d3s.schedule_steps, cycling over the prompts as it needs."""
    flags = PARTS[part][method][1]
    return any(flag in flags for flag in ("--d3s.pilot_rollouts", "--d3s.prompt_skip", *DYNAMIC_FILTERING))


def rl_config(prepared, part, method, seed, steps, eval_every, prompts=PROMPTS, fp32=True, pool=None, lr=None):
    """The run's configuration: ``steps`` rollout steps over the first ``pool`` RL prompts (the screen and speed
    parts: the pool of the passes regime, or the whole RL split of the fresh one), at learning rate ``lr`` (None:
    the demo's 2e-4).

    In the screen and speed parts every arm trains exactly ``steps`` steps with --d3s.schedule_steps ``steps``: the
    arms that drop prompts by their fixed steps, cycling over the pool as often as they need, the others by
    upstream's passes (whole passes over the pool; over a pool of more than ``steps`` x ``prompts``, one pass over
    its first ones).
    """
    group, flags = PARTS[part][method]
    pass_steps, episodes = steps, 1
    extra = list(flags)
    if part in FIXED_STEP_PARTS:
        pass_steps = pool // prompts
        if not drops_prompts(part, method):
            pass_steps = min(pass_steps, steps)
            episodes = steps // pass_steps
        extra += ["--d3s.schedule_steps", steps]
    config = pipeline.demo_rl_config(pipeline.TaskConfig(), episodes=episodes, prepared=prepared)
    if eval_every:
        extra += ["--ckpt.save_steps", eval_every, "--ckpt.save_hf", "--ckpt.disable_ds"]
    config = dataclasses.replace(
        config, prompts_per_step=prompts, samples_per_prompt=group, steps=pass_steps, seed=seed, extra=extra, fp32=fp32
    )
    return config if lr is None else dataclasses.replace(config, lr=lr)


def run(
    prepared,
    task,
    part,
    method,
    seed,
    workdir,
    steps,
    eval_every,
    samples,
    prompts=PROMPTS,
    fp32=True,
    regime=None,
    pool=None,
    lr=None,
    keep_models=True,
    cap=None,
):
    """One RL run and its held-out evaluations; returns the per-step metrics and the evaluation curve. ``regime``
    (screen and speed parts): "passes" over the first ``pool`` prompts, or "fresh" ones (``pool``: the whole RL
    split); ``lr``: the learning rate (None: the demo's); ``keep_models=False``: the saved checkpoints and final
    model are deleted once evaluated (the run's log and events stay). ``cap``: seconds after which the run is
    stopped and kept as it is (``stopped``: its logged steps and the checkpoints saved before its last logged step;
    a policy that collapsed under dynamic filtering or screening at fixed steps can spend hours generating groups
    that are all flat); without it a run that has not ended after an hour fails."""
    config = rl_config(prepared, part, method, seed, steps, eval_every, prompts, fp32, pool, lr)
    rate = "" if lr is None else f"-lr{lr:g}"
    name = f"{part}-{regime}-{method}{rate}-seed{seed}" if regime else f"{part}-{method}{rate}-seed{seed}"
    run_dir = os.path.join(workdir, name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run stopped before: its events and checkpoints would mix in
    command = pipeline.launcher_command(
        pipeline.D3S_ENTRYPOINT, pipeline.ppo_args(prepared.sft_model, prepared.task, run_dir, config), config.fp32
    )
    log = os.path.join(workdir, f"{name}.log")
    started = time.time()
    stopped = False
    try:
        rc = pipeline.run_logged(command, log, timeout=cap or 3600)
    except TimeoutError:
        if cap is None:
            raise
        stopped, rc = True, 0
    if rc != 0:
        raise RuntimeError(f"{name} failed (exit {rc}); see {log}")
    seconds = time.time() - started
    scalars = read_train_scalars(os.path.join(run_dir, "tensorboard"))
    logged = [{"step": step, **{key: values[key] for key in KEYS if key in values}} for step, values in scalars.items()]
    models = {
        int(CHECKPOINT.search(path).group(1)): path
        for path in glob.glob(os.path.join(run_dir, "checkpoints", "global_step*_hf"))
    }
    if stopped:  # no final model; a checkpoint of the last logged step may have been cut off while it was written
        models = {step: path for step, path in models.items() if step < len(logged)}
    else:
        models[len(logged)] = os.path.join(run_dir, "final_model")
    started_eval = time.time()
    evaluation = dict(seed=seed, task=task, max_new_tokens=prepared.max_new_tokens, samples=samples)
    curve = [
        {"step": step, **evaluate.heldout_accuracy(path, prepared.task.heldout, **evaluation)}
        for step, path in sorted(models.items())
    ]
    eval_seconds = time.time() - started_eval
    if not keep_models:  # every saved model: the last checkpoint too, which the final model stands in for
        for path in ("checkpoints", "final_model"):
            shutil.rmtree(os.path.join(run_dir, path), ignore_errors=True)
    return {
        "group": config.samples_per_prompt,
        "steps": logged,
        "heldout": curve,
        "process_seconds": seconds,
        "eval_seconds": eval_seconds,
        "stopped": stopped,
    }


def load(path):
    return json.loads(Path(path).read_text()) if os.path.exists(path) else None


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default=DEFAULT_TASK, help="task module (import path or .py file)")
    parser.add_argument("--out", default=str(HERE / "results"), help="results directory")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: OUT/learning_runs)")
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["pods", "d3s"],
        choices=list(RESULTS_FILES),
        help="default: pods d3s; screen runs alone (the speed study: benchmarks/bench_speed.py)",
    )
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods (names as in PARTS)")
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES, help="the screen part's")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"RL steps per run (8 prompts each; default 100, in the screen part {SCREEN_STEPS})",
    )
    parser.add_argument(
        "--pool",
        type=int,
        default=PASSES_PROMPTS,
        help=f"the screen part's passes regime: RL prompts cycled over (default {PASSES_PROMPTS}; a multiple of "
        "--prompts whose batches divide --steps)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=None, help="held-out evaluation every this many steps (default 20, screen 25)"
    )
    parser.add_argument("--eval-samples", type=int, default=4, help="sampled responses per held-out prompt")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per RL step")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32: SFT and RL under the CPU launcher's --fp32 (bf16 is emulated, ~9x slower, on CPUs without "
        "native bf16); bf16: upstream's --ds.param_dtype default",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke-test the whole chain: SFT (1 epoch, 64 examples), every method 1 seed x 3 steps (the screen "
        "part: the task's own SFT, 4 steps, a pool of 2 batches), evaluation every 2 steps on 16 held-out prompts, "
        "and the report",
    )
    parser.add_argument("--no-report", action="store_true", help="skip report.py --study on the results")
    options = parser.parse_args(argv)
    screen = "screen" in options.parts
    if screen and options.parts != ["screen"]:
        raise SystemExit("run the screen part alone (--parts screen): it has its own results file")
    if options.quick:
        options.seeds, options.eval_every, options.eval_samples = [0], 2, 2
        options.steps, options.pool = (4, 2 * options.prompts) if screen else (3, options.pool)
    if options.steps is None:
        options.steps = SCREEN_STEPS if screen else 100
    if options.eval_every is None:
        options.eval_every = 25 if screen else 20
    if screen and "passes" in options.regimes:
        check_pool(options.pool, options.prompts, options.steps)
    return options


def check_pool(pool, prompts, steps):
    """The passes regime's pool: whole batches that divide the steps (the arms that drop no prompt train whole
    passes over it)."""
    batches = pool // prompts
    if pool % prompts or not batches or steps % batches:
        raise SystemExit(
            f"--pool {pool} must be a multiple of --prompts {prompts} whose batches ({batches}) divide --steps "
            f"{steps}: the arms that drop no prompt train whole passes over it"
        )


def task_overrides(options):
    """The task config's overrides: the quick chain's sizes; the screen part's RL split, large enough that the fresh
    regime never cycles."""
    if options.parts == ["screen"]:  # the quick chain keeps the task's SFT: a weak warm start solves no prompt, so
        # every pilot and group would be flat and the dropping arms would stop at their stall guard
        return (
            dict(n_prompts=4 * options.steps * options.prompts, n_heldout=16)
            if options.quick
            else dict(n_prompts=FRESH_PROMPTS)
        )
    return dict(n_sft=64, n_prompts=3 * options.prompts, n_heldout=16, sft_epochs=1) if options.quick else {}


def task_dir_name(task):
    """A task's import path or file as a directory name."""
    return re.sub(r"\W+", "_", task)


def prepare_task(task, precision, task_config, workdir, split=""):
    """The SFT warm start in ``workdir``, shared by every run with the same task, precision and ``split`` (a name
    for the task config's sizes where they are not the task's own); ``(prepared, SFT seconds or None when
    reused)``."""
    prepare_dir = os.path.join(workdir, f"task-{task_dir_name(task)}-{precision}{split}")
    if os.path.exists(os.path.join(prepare_dir, "prepared.json")):
        prepared = pipeline.Prepared(**load(os.path.join(prepare_dir, "prepared.json")))
        return dataclasses.replace(prepared, task=pipeline.TaskFiles(**prepared.task)), None
    started = time.time()
    prepared = pipeline.prepare(
        prepare_dir, task_config, log_path=os.path.join(workdir, "sft.log"), fp32=precision == "fp32"
    )
    Path(prepare_dir, "prepared.json").write_text(json.dumps(dataclasses.asdict(prepared)))
    return prepared, time.time() - started


def open_document(options, results_path):
    """The results so far in ``results_path``, refused if they are another study's."""
    document = load(results_path) or {}
    recorded = {"quick": False, **document} if document else {}  # results from before the key are a full study
    for key, value in (("task", options.task), ("precision", options.precision), ("quick", options.quick)):
        if recorded.get(key, value) != value:  # one --out holds one study
            raise SystemExit(f"{results_path} holds results of {key} {recorded[key]}; give another --out")
    return document


def main(argv=None):
    options = parse_options(argv)
    out = os.path.abspath(options.out)
    workdir = os.path.abspath(options.workdir or os.path.join(out, "learning_runs"))
    results_path = os.path.join(out, RESULTS_FILES[options.parts[0]])
    document = open_document(options, results_path)
    for directory in (out, workdir):  # out too when the runs go elsewhere: each result is saved as its run ends
        os.makedirs(directory, exist_ok=True)
    task_config = pipeline.task_config(options.task, **task_overrides(options))
    if options.prompts * options.steps > task_config.n_prompts:
        raise SystemExit(
            f"{options.steps} steps x {options.prompts} prompts need {options.prompts * options.steps} RL prompts; "
            f"the task config has {task_config.n_prompts}"
        )
    started = time.time()
    split = f"-prompts{task_config.n_prompts}" if options.parts == ["screen"] else ""
    prepared, sft_seconds = prepare_task(options.task, options.precision, task_config, workdir, split)
    evaluation = dict(task=options.task, max_new_tokens=prepared.max_new_tokens, samples=options.eval_samples)
    if "sft_heldout" not in document or sft_seconds is not None:  # a new warm start is evaluated anew
        document["sft_heldout"] = evaluate.heldout_accuracy(
            prepared.sft_model, prepared.task.heldout, seed=0, **evaluation
        )
        print(f"SFT warm start: held-out {document['sft_heldout']}", flush=True)
    document.update(
        task=options.task,
        precision=options.precision,
        quick=options.quick,
        task_config=dataclasses.asdict(task_config),
        machine=f"{cpu_model()}, {os.cpu_count()} CPUs",
        prompts_per_step=options.prompts,
        steps=options.steps,
        eval_every=options.eval_every,
        eval_samples=options.eval_samples,
    )
    if options.parts == ["screen"]:
        document.update(pool=options.pool, pilot=PILOT, audit=AUDIT)
    if sft_seconds is not None:
        document["sft_seconds"] = sft_seconds
    run_all(options, prepared, document, workdir, results_path)
    print(f"wrote {results_path} ({time.time() - started:.0f}s)")
    if not options.no_report:
        report(options, results_path, out)
    return results_path


def run_all(options, prepared, document, workdir, results_path):
    """Every selected run, seed-major (a drift of the machine's speed hits every method alike), each saved to
    ``results_path`` as it ends; the screen part's under its regime's name."""
    for seed in options.seeds:
        for part in options.parts:
            regimes = options.regimes if part == "screen" else [None]
            methods = [m for m in PARTS[part] if options.methods is None or m in options.methods]
            for regime, method in ((regime, method) for regime in regimes for method in methods):
                result = run(
                    prepared,
                    options.task,
                    part,
                    method,
                    seed,
                    workdir,
                    options.steps,
                    options.eval_every,
                    options.eval_samples,
                    options.prompts,
                    options.precision == "fp32",
                    regime=regime,
                    pool=options.pool if regime == "passes" else document["task_config"]["n_prompts"],
                )
                result["flags"] = [str(flag) for flag in PARTS[part][method][1]]
                result["date"] = time.strftime("%Y-%m-%d")
                results = document.setdefault("results", {}).setdefault(regime or part, {})
                results.setdefault(method, {})[str(seed)] = result
                Path(results_path).write_text(json.dumps(document, indent=1))
                final = result["heldout"][-1]
                print(
                    f"{regime or part}/{method} seed {seed}: held-out greedy {final['greedy']:.3f}, sampled "
                    f"{final['sampled']:.3f}; run {result['process_seconds']:.0f}s + eval "
                    f"{result['eval_seconds']:.0f}s",
                    flush=True,
                )


def report(options, results_path, out):
    if options.parts == ["screen"]:
        from reporting.generation_study import generation_main

        generation_main(results_path, os.path.join(out, "generation_study.md"))
    else:
        from report import study_main

        study_main(results_path, os.path.join(out, "learning_study.md"))


if __name__ == "__main__":
    main()
