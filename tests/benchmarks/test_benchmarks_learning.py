"""The learning study's plumbing (benchmarks/bench_learning.py, benchmarks/report.py --study) and the demo, on a
task module written here (outside the repository): SFT, a real Ray RL run, held-out evaluation of saved
checkpoints, the report."""

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_learning  # noqa: E402
import report  # noqa: E402
from d3s_openrlhf.cli import demo  # noqa: E402
from reporting import claims, stats, study  # noqa: E402

# 3-letter words over "abcd" reversed; small enough for a 1-epoch SFT and 1-2 RL steps
TASK = """
import itertools
import random

TASK_CONFIG = dict(n_sft=20, n_prompts=16, n_heldout=8, sft_epochs=1, sft_batch_size=4)


def make_examples(split, n, seed):
    words = ["".join(w) for w in itertools.product("abcd", repeat=3)]
    random.Random(seed).shuffle(words)
    chosen = words[{"sft": 0, "rl": 1, "heldout": 2}[split] :: 3][:n]
    return [{"prompt": w + ">", "answer": w[::-1], "sft_response": w[::-1]} for w in chosen]


def reward(response, answer):
    return float(response == answer)
"""


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "outside" / "reverse_task.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(TASK))
    return str(path)


@pytest.mark.parametrize(
    "a, b", [([1, 2, 3], [4, 5, 7]), ([0.4, 0.45, 0.5], [0.42, 0.6, 0.61, 0.7]), ([1, 2], [1.5, 9])]
)
def test_welch_t_test_matches_the_incomplete_beta_reference(a, b):
    import mpmath
    import numpy as np

    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t_ref = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    p_ref = float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t_ref**2), regularized=True))  # P(|T| > |t|)
    t, p = stats.welch_t_test(a, b)
    assert t == pytest.approx(t_ref, rel=1e-12) and p == pytest.approx(p_ref, abs=1e-5)


def test_welch_t_test_degenerate_samples():
    t, p = stats.welch_t_test([1, 2, 3], [1, 2, 3])
    assert t == 0.0 and p == pytest.approx(1.0, abs=1e-6)
    assert all(math.isnan(v) for v in stats.welch_t_test([1.0], [2.0, 3.0]))


def test_study_methods_generate_and_train_as_published():
    pods, family = bench_learning.PARTS["pods"], bench_learning.PARTS["d3s"]
    assert pods["GRPO"][0] == bench_learning.PODS_M and pods["PODS"][0] == 4 * bench_learning.PODS_M
    for method in ("PODS", "PODS-random", "PODS-max-reward"):
        flags = [str(f) for f in pods[method][1]]
        assert flags[flags.index("--d3s.n_init") + 1] == str(bench_learning.PODS_M)
    assert {group for group, _ in family.values()} == {bench_learning.G}
    d2s, d3s = ([str(f) for f in family[m][1]] for m in ("D2S", "D3S"))
    mean = lambda flags, a, b: (float(flags[flags.index(a) + 1]) + float(flags[flags.index(b) + 1])) / 2  # noqa: E731
    # D2S against D3S isolates the schedule: the same mean N and K
    assert mean(d2s, "--d3s.n_init", "--d3s.n_final") == mean(d3s, "--d3s.n_init", "--d3s.n_final")
    assert mean(d2s, "--d3s.k_init", "--d3s.k_final") == mean(d3s, "--d3s.k_init", "--d3s.k_final")


def test_quick_results_do_not_mix_with_a_study(task_file, tmp_path):
    out, runs = tmp_path / "results", tmp_path / "runs"
    out.mkdir()
    (out / "learning_study.json").write_text(json.dumps({"task": task_file, "precision": "fp32", "quick": True}))
    with pytest.raises(SystemExit, match="holds results of quick True; give another --out"):
        bench_learning.main(["--task", task_file, "--out", str(out), "--workdir", str(runs), "--steps", "2"])
    assert not list(runs.glob("task-*"))  # refused before the SFT warm start
    # results from before the study recorded --quick are a full study's
    (out / "learning_study.json").write_text(json.dumps({"task": task_file, "precision": "fp32"}))
    with pytest.raises(SystemExit, match="holds results of quick False"):
        bench_learning.main(["--task", task_file, "--out", str(out), "--workdir", str(runs), "--quick"])


@pytest.mark.e2e
def test_study_chain_on_a_task_module_outside_the_repo(task_file, tmp_path):
    out, runs = tmp_path / "results", tmp_path / "runs"  # out does not exist yet and the runs go elsewhere
    study_flags = ["--parts", "pods", "--methods", "PODS", "--seeds", "0", "--steps", "2", "--eval-every", "1"]
    sizes = ["--eval-samples", "2", "--prompts", "8"]
    path = bench_learning.main(["--task", task_file, "--out", str(out), "--workdir", str(runs), *study_flags, *sizes])
    assert Path(path) == out / "learning_study.json"
    document = json.loads(Path(path).read_text())
    # float32 by default: the launcher's switch reached the run, and the vLLM engine generated in float32
    log = (runs / "pods-PODS-seed0.log").read_text()
    assert document["precision"] == "fp32" and "float32 for every model" in log and "dtype=torch.float32" in log
    # the runtime's VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's executor ran inside its engine-core process
    assert "(EngineCore pid=" in log and "(Worker pid=" not in log
    run = document["results"]["pods"]["PODS"]["0"]
    assert [e["step"] for e in run["heldout"]] == [1, 2]
    assert all(0.0 <= e["greedy"] <= 1.0 and e["entropy"] >= 0.0 for e in run["heldout"])
    assert [s["rollout/num_samples"] for s in run["steps"]] == [8 * 16] * 2  # PODS generates n = 16 per prompt
    assert [s["d3s/kept_rollouts"] for s in run["steps"]] == [8 * 4] * 2  # and trains m = 4
    assert all("d3s/zero_var_groups" in s for s in run["steps"])
    written = report.study_main(path, str(out / "study.md"))
    text = Path(written).read_text()
    assert "| PODS | 16 | 1 |" in text and (out / "study.png").exists()

    # the demo, on the same task module: 1 RL step (16 prompts), the summary names the task
    demo.main(["--out", str(tmp_path / "demo"), "--task", task_file, "--episodes", "1", "--grpo-only"])
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["task"] == task_file and len(summary["steps"]) == 1
    assert set(summary["heldout_accuracy"]["rl"]) == {"greedy", "sampled", "pass@8", "entropy"}


# -- report.py on a synthetic study: every claim's verdict follows from the numbers --------------------------------
def synthetic_run(greedy, grad, kept_tokens, step_time, eval_every=2):
    """A run of len(greedy) * eval_every steps whose held-out greedy accuracy is ``greedy`` at the evaluations."""
    steps = [
        {
            "step": i + 1,
            "rollout/reward_mean": greedy[i // eval_every] - 0.05,
            "rollout/response_length_mean": 20.0,
            "rollout/num_samples": 128,
            "d3s/kept_tokens": kept_tokens,
            "d3s/zero_var_groups": 1.0,
            "d3s/select_time_s": 0.001,
            "actor_grad_norm": grad,
            "timing/generation": step_time / 2,
            "timing/make_experience": step_time / 4,
            "timing/ppo_train": step_time / 4,
            "timing/step_total": step_time,
        }
        for i in range(len(greedy) * eval_every)
    ]
    heldout = [
        {"step": eval_every * (i + 1), "greedy": g, "sampled": g - 0.05, "entropy": 0.1} for i, g in enumerate(greedy)
    ]
    return {"group": 16, "steps": steps, "heldout": heldout, "date": "2026-11-24"}


def synthetic_study(d3s_curve=(0.62, 0.63)):
    def seeds(curve, grad=1.0, tokens=100.0, step_time=1.0, noisy=(1,)):
        # seed k adds 0.01 k to the evaluations in ``noisy`` (and to the grad norm), so that tests have a spread
        return {
            str(k): synthetic_run(
                [g + (0.01 * k if i in noisy else 0.0) for i, g in enumerate(curve)], grad + 0.01 * k, tokens, step_time
            )
            for k in range(3)
        }

    return {
        "task": "synthetic",
        "precision": "fp32",
        "machine": "test",
        "task_config": {"n_sft": 10, "sft_epochs": 1, "n_heldout": 8},
        "prompts_per_step": 8,
        "eval_every": 2,
        "eval_samples": 2,
        "sft_heldout": {"greedy": 0.2, "sampled": 0.2},
        "results": {
            "pods": {
                "GRPO": seeds([0.4, 0.6]),  # peak 0.61 (seed mean) at step 4, 4 s
                "PODS": seeds([0.62, 0.66]),  # reaches it at step 2, 2 s: 2x
                "PODS-random": seeds([0.5, 0.55]),
                "PODS-max-reward": seeds([0.3, 0.35]),
            },
            "d3s": {
                "GRPO": seeds([0.4, 0.6]),  # final 0.61 at step 4, 4 s
                "D1S": seeds([0.7, 0.5]),  # falls 0.2 from its peak
                "D1S-Cross": seeds([0.6, 0.6], noisy=()),  # no spread, no fall: steadier than D1S
                "D2S": seeds([0.7, 0.45]),
                "D3S": seeds(d3s_curve, grad=3.0, tokens=10.0, step_time=0.8),  # 1.6 s to GRPO's final: 2.5x
                "D3S-I": seeds([0.6, 0.6], noisy=()),
            },
        },
    }


def claim_lines(document):
    """The study's claims as RESULTS.md prints them: the machine's drift, then one line per claim."""
    parts = study.study_analysis(document)
    return [claims.drift_line(parts), *(claim.line for claim in claims.claims(parts, document["eval_every"]))]


def test_claims_follow_from_the_numbers():
    lines = claim_lines(synthetic_study())
    expected = {
        'PODS, "reaches GRPO\'s peak at least 1.7x sooner": **agrees**': "a speed-up of 2.00x in wall time (GRPO's",
        'rule ablation, "max-variance > random > max-reward"': "**agrees**",
        'D3S, "2.04x faster than GRPO": **agrees**': "a speed-up of 2.50x in wall time, 2.00x in steps (GRPO's over",
        "GRPO's final held-out greedy 0.610": "On the training reward (10-step mean, per step) GRPO reaches its final",
        'D3S, "under 20% of the tokens": **agrees**': "10.0% of GRPO's policy-gradient tokens",
        'D3S, "a higher gradient norm": **agrees**': "(2.98x",
        '"D1S and D2S overfit without the schedule": **agrees**': "D1S 0.190 ± 0.010",
        # D3S is less steady than D3S-I, but D1S-Cross steadier than D1S: mixed
        'less stable than intra-group" (seen on unaligned Llama3.1-8B-Instruct): **not resolved': "D1S-Cross",
    }
    assert len(lines) == 8  # the drift, then one line per claim
    assert "varied by up to 0%" in lines[0]  # every seed of a method has the same step time here
    for head, detail in expected.items():
        assert any(head in line and detail in line for line in lines), (head, lines)


def test_a_method_that_never_reaches_grpo_is_a_disagreement():
    lines = claim_lines(synthetic_study(d3s_curve=(0.3, 0.35)))
    assert any('"2.04x faster than GRPO": **disagrees** (held-out accuracy: never reached' in line for line in lines)


def test_the_training_reward_clock_alone_cannot_agree():
    # D3S never reaches GRPO's final held-out accuracy, but its training reward gets to GRPO's final reward at
    # step 1 (1.5 s) against GRPO's step 4 (4 s), 2.67x: at most unresolved, since that clock is in-sample
    document = synthetic_study(d3s_curve=(0.3, 0.35))
    for run in document["results"]["d3s"]["D3S"].values():
        for step in run["steps"]:
            step["rollout/reward_mean"] = 0.9
            step["timing/step_total"] = 1.5
    lines = claim_lines(document)
    line = next(line for line in lines if '"2.04x faster than GRPO"' in line)
    assert "**not resolved at this scale** (only the in-sample training-reward clock" in line, line
    assert "by D3S never" in line and "a speed-up of 2.67x in wall time (GRPO's over D3S's)" in line, line


def test_results_page_has_the_study_as_section_2(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in ("selection.json", "step_cost.json"):
        (results / name).write_text((BENCHMARKS / "results" / name).read_text())
    (results / "learning_study.json").write_text(json.dumps(synthetic_study()))
    report.main(["--results", str(results), "--output", str(tmp_path / "RESULTS.md")])
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## 2. Learning efficiency: the study" in text and "### Part `pods`" in text
    assert "- Study, part `d3s` (section 2): final held-out greedy GRPO 0.610, D1S 0.510 (p = " in text
    assert (
        "D3S 0.640 (p = " in text
        and "trained tokens against GRPO's: D1S 1.00, D1S-Cross 1.00, D2S 1.00, D3S 0.10" in text
    )
    assert 'claims at this scale (section 2): PODS, "reaches GRPO\'s peak at least 1.7x sooner": agrees;' in text
    # early learning: at step 2 the pods part's GRPO (0.40) is below PODS (0.62) and PODS-random (0.50) only
    assert "- Part `pods`, first evaluation (step 2): GRPO 0.400, PODS 0.620" in text and "(2 of 3 above GRPO)" in text
    assert (results / "learning_study.png").exists()


def test_a_baseline_without_gradient_has_no_norm_ratio():
    # every GRPO group had equal rewards (a --quick run from a poor warm start): its gradient norm is 0
    document = synthetic_study()
    for run in document["results"]["d3s"]["GRPO"].values():
        for step in run["steps"]:
            step["actor_grad_norm"] = 0.0
    line = next(line for line in claim_lines(document) if '"a higher gradient norm"' in line)
    assert "nan" not in line and "against GRPO's 0.00 ± 0.00 (no ratio: GRPO's norm is 0, Welch p = " in line, line


def test_a_quick_study_says_it_is_a_smoke_test(tmp_path):
    path = tmp_path / "learning_study.json"
    path.write_text(json.dumps({**synthetic_study(), "quick": True}))
    text = Path(report.study_main(str(path), str(tmp_path / "study.md"))).read_text()
    assert "`.venv/bin/python benchmarks/bench_learning.py --quick --task synthetic --precision fp32`" in text
    assert "A `--quick` smoke test" in text
    path.write_text(json.dumps(synthetic_study()))
    text = Path(report.study_main(str(path), str(tmp_path / "study.md"))).read_text()
    assert "--quick" not in text


def test_a_wall_time_ratio_within_the_machines_drift_is_not_resolved():
    document = synthetic_study()
    for step in document["results"]["d3s"]["GRPO"]["2"]["steps"]:
        step["timing/step_total"] = 1.5  # one seed ran slower: the drift is 0.5 / mean(1, 1, 1.5) = 43%
    for run in document["results"]["d3s"]["D3S"].values():
        for step in run["steps"]:
            step["timing/step_total"] = 14 / 3 / 1.9 / 2  # GRPO's 14/3 s to its final over D3S's 2 steps: 1.9x
    lines = claim_lines(document)
    assert "varied by up to 43%" in lines[0]
    assert any('"2.04x faster than GRPO": **not resolved at this scale**' in line and "1.90x" in line for line in lines)


@pytest.mark.parametrize("cap", [None, 60.0])
def test_a_run_past_its_cap_is_kept_with_what_it_saved(cap, tmp_path, monkeypatch):
    """A run still going at ``cap`` is stopped and kept: its logged steps and the checkpoints saved before its last
    logged step (one of that step may be cut off mid-write), no final model; without a cap, the timeout fails it."""
    from d3s_openrlhf.testbed import pipeline

    workdir = tmp_path / "runs"

    def stalled(command, log, timeout=None):
        assert timeout == (cap or 3600)
        (run_dir,) = workdir.glob("speed-fresh-GRPO+DF-lr0.0002-seed0")
        for step in (2, 3):
            (run_dir / "checkpoints" / f"global_step{step}_hf").mkdir(parents=True)
        raise TimeoutError("still generating")

    def launch(*args):
        (workdir / "speed-fresh-GRPO+DF-lr0.0002-seed0").mkdir(parents=True)
        return ["train"]

    monkeypatch.setattr(pipeline, "run_logged", stalled)
    monkeypatch.setattr(pipeline, "launcher_command", launch)
    monkeypatch.setattr(pipeline, "ppo_args", lambda *args: [])
    monkeypatch.setattr(
        bench_learning, "read_train_scalars", lambda path: {s: {"rollout/num_samples": 128} for s in (1, 2, 3)}
    )
    evaluated = []
    monkeypatch.setattr(
        bench_learning.evaluate,
        "heldout_accuracy",
        lambda path, heldout, **kw: evaluated.append(Path(path).name) or {"greedy": 0.0},
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join('{"input": "q%d", "label": "a"}\n' % i for i in range(4000)))
    files = pipeline.TaskFiles(sft="sft.jsonl", prompts=str(prompts), heldout="heldout.jsonl")
    prepared = pipeline.Prepared(base_model="base", sft_model="sft", task=files, reward_file="r.py")
    arguments = (prepared, "pkg.task", "speed", "GRPO+DF", 0, str(workdir), 4, 2, 0)
    options = dict(regime="fresh", pool=4000, lr=2e-4, keep_models=False, cap=cap)
    if cap is None:
        with pytest.raises(TimeoutError):
            bench_learning.run(*arguments, **options)
        return
    result = bench_learning.run(*arguments, **options)
    assert result["stopped"] and len(result["steps"]) == 3
    assert evaluated == ["global_step2_hf"] and [e["step"] for e in result["heldout"]] == [2]


# -- the screen part (generation_study.json): equal steps, the section and its verdict -----------------------------
@pytest.mark.parametrize("part", ["screen", "speed"])
@pytest.mark.parametrize("regime, pool", [("passes", 200), ("fresh", 4000)])
def test_every_arm_of_the_screen_and_speed_parts_trains_the_same_steps(part, regime, pool, tmp_path):
    from d3s_openrlhf.cli.train_ppo_ray import resolve
    from d3s_openrlhf.integration import host
    from d3s_openrlhf.testbed import pipeline

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join('{"input": "q%d", "label": "a"}\n' % i for i in range(4000)))
    files = pipeline.TaskFiles(sft="sft.jsonl", prompts=str(prompts), heldout="heldout.jsonl")
    prepared = pipeline.Prepared(base_model="base", sft_model="sft", task=files, reward_file="r.py")
    for method in bench_learning.PARTS[part]:
        config = bench_learning.rl_config(prepared, part, method, 0, 150, 25, pool=pool, lr=1e-4)
        argv = [str(flag) for flag in pipeline.ppo_args("sft", files, str(tmp_path), config)]
        assert argv[argv.index("--actor.adam.lr") + 1] == "0.0001"
        d3s, _, host_args, _ = resolve(argv)
        fixed = host.fixed_steps(d3s, host_args)
        if bench_learning.drops_prompts(part, method):  # its fixed steps, over the pool cycled as it needs
            assert fixed == 150 and config.steps * config.prompts_per_step == pool, method
        else:  # upstream's passes: whole ones over the pool, or one pass over fresh prompts
            assert fixed is None and config.steps * config.episodes == 150, method
            assert config.steps * config.prompts_per_step == min(pool, 150 * 8), method
            assert host.rollout_steps(config.steps * config.prompts_per_step, host_args) == 150


def synthetic_generation_study(goal_curve, goal_time=0.4, screened=2.0):
    """Two regimes of the five arms, 3 seeds, 4 steps, evaluations at steps 2 and 4; GRPO reaches its final 0.61 at
    step 4 (4 s, 4 x 320 generated tokens); the goal arm generates 100 tokens a step."""

    def seeds(curve, step_time=1.0, generated=320.0, screen=False):
        runs = {}
        for k in range(3):
            run = synthetic_run([g + 0.01 * k for g in curve], 1.0, 100.0, step_time)
            run.update(process_seconds=60.0, eval_seconds=5.0)
            for step in run["steps"]:
                step["d3s/generated_tokens"] = generated
                if screen:
                    step.update({"d3s/pilots": 8.0 + screened, "d3s/screened_prompts": screened})
                    step.update({"d3s/audited_prompts": 1.0, "d3s/false_rejects": 0.5 if k else 0.0})
            runs[str(k)] = run
        return runs

    arms = {
        "GRPO": seeds([0.4, 0.6]),
        "GRPO+DF": seeds([0.45, 0.6], step_time=1.3, generated=400.0),
        "GRPO+screen": seeds([0.4, 0.6], step_time=0.7, generated=200.0, screen=True),
        "D3S": seeds([0.5, 0.62], step_time=0.8),
        "D3S+screen+history": seeds(goal_curve, step_time=goal_time, generated=100.0, screen=True),
    }
    return {
        "task": "synthetic",
        "machine": "test",
        "prompts_per_step": 8,
        "steps": 4,
        "eval_every": 2,
        "pool": 16,
        "pilot": 4,
        "audit": 0.1,
        "sft_heldout": {"greedy": 0.2, "sampled": 0.2},
        "sft_seconds": 10.0,
        "results": {"passes": arms, "fresh": json.loads(json.dumps(arms))},
    }


def test_the_generation_study_section_and_its_reading(tmp_path):
    from reporting import generation_study

    met = synthetic_generation_study([0.62, 0.66])  # GRPO's final reached at step 2: 0.8 s, 2 x 100 tokens
    path = tmp_path / "generation_study.json"
    path.write_text(json.dumps(met))
    text = "\n".join(generation_study.generation_section(path, 12))
    assert (
        text.count("**Reading** (") == 2 and "Several passes over 16 prompts" in text and "One pass over fresh" in text
    )
    assert "Met" not in text and "goal" not in text  # a time to GRPO's final accuracy is no speed to judge
    # reached at step 2, the first evaluation: the sentence says the ratios read the grid
    assert "at step 2, its first evaluation: the ratios read that evaluation's share of the run" in text
    assert "with 0.16x GRPO's generated tokens and 0.20x its wall time" in text  # 200 / 1280, 0.8 / 4
    target, info = generation_study.regime_analysis(met, "fresh")
    goal = info["D3S+screen+history"]
    assert target == pytest.approx(0.61) and goal["reach_step"] == 2
    assert goal["acceptance"] == pytest.approx(8 / 10) and goal["false_reject"] == (pytest.approx(4 / 12), 12)
    assert goal["at_grpo_wall"] == pytest.approx(0.67)  # it ended (1.6 s) before GRPO's 4 s: its final evaluation
    assert info["GRPO+DF"]["at_grpo_wall"] == pytest.approx(0.46)  # 2.6 s to step 2, 5.2 s to step 4 > 4 s
    assert info["GRPO"]["ratios"]["wall"] == pytest.approx(1.0) and info["GRPO"]["acceptance"] is None
    assert info["GRPO"]["peak_target"] == pytest.approx(0.61) and goal["reach"]["peak"]["step"] == 2
    assert "To the peak of GRPO's seed-mean curve (0.610)" in text
    low, high = goal["intervals"]["wall"]
    assert low - 1e-9 <= 0.2 <= high + 1e-9  # the point ratio lies in its bootstrap interval
    slow = synthetic_generation_study([0.62, 0.66], goal_time=2.0)
    slow_info = generation_study.regime_analysis(slow, "fresh")[1]
    slow_text = generation_study.reading(slow_info, "fresh", 4, eval_every=1)  # step 2 is not the first evaluation
    assert "at step 2, with 0.16x GRPO's generated tokens and 1.00x its wall time" in slow_text
    assert "each 4 rollouts generated for no training" in slow_text
    never = synthetic_generation_study([0.3, 0.35])
    never_text = generation_study.reading(generation_study.regime_analysis(never, "passes")[1], "passes", 4, 2)
    assert "never reached GRPO's final accuracy" in never_text
    assert "each 4 rollouts generated for no training" in never_text
    degraded = synthetic_generation_study([0.62, 0.66])
    for run in degraded["results"]["passes"]["GRPO"].values():  # GRPO ends below the warm start (0.2)
        run["heldout"][-1]["greedy"] = 0.1
    degraded_text = generation_study.reading(generation_study.regime_analysis(degraded, "passes")[1], "passes", 4, 2)
    assert "GRPO's final accuracy (0.100) is no better than the warm start's" in degraded_text
    assert "reached GRPO's peak held-out greedy accuracy (0.410) at step" in degraded_text
    assert "with 0.31x GRPO's generated tokens" in degraded_text  # 200 / 640
    written = generation_study.generation_main(path, tmp_path / "generation.md")
    assert Path(written).read_text().startswith("# The generation level at fixed steps on `synthetic`")


def test_a_bootstrap_interval_next_to_never_is_an_order_statistic():
    from reporting import generation_study

    assert generation_study._interval([0.3] * 90 + [float("inf")] * 10) == (0.3, float("inf"))
    assert generation_study._interval([float("inf")] * 100) == (float("inf"), float("inf"))
    low, high = generation_study._interval([float("nan"), 0.2, 0.4])
    assert (low, high) == (0.2, 0.4)
