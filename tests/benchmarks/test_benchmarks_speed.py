"""The speed study (benchmarks/bench_speed.py, benchmarks/reporting/speed.py, the statistics of
benchmarks/reporting/stats.py) on synthetic curves: interpolated times to a threshold, censoring, areas up to a budget,
collapses, the choice of learning rate, the t-intervals of means and log ratios and their bounds, the report's numbers
and structure; the runner's appending and resuming with a stand-in launcher, its phase at one rate; each arm's run
configuration, the evaluated steps and the run cap."""

import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_speed  # noqa: E402
import report  # noqa: E402
from reporting import speed, stats  # noqa: E402


def curve(greedy, step_s=1.0, tokens=100.0, every=10, warm=None):
    """A curve evaluated every ``every`` steps of ``step_s`` seconds and ``tokens`` generated tokens each; the warm
    start (step 0) is ``warm`` or the first value of ``greedy``."""
    values = list(greedy) if warm is None else [warm, *greedy]
    return [
        {"step": every * i, "wall": every * i * step_s, "generated": every * i * tokens, "greedy": g}
        for i, g in enumerate(values)
    ]


# -- the pure functions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clock, expected", [("step", 15.0), ("wall", 30.0), ("generated", 1500.0)])
def test_time_to_a_threshold_is_interpolated_between_evaluations(clock, expected):
    points = curve([0.4, 0.5, 0.8, 0.9], step_s=2.0)  # 0.65 is halfway from step 10 (0.5) to step 20 (0.8)
    assert speed.time_to(points, 0.65, clock) == (pytest.approx(expected), False)


def test_time_to_takes_the_first_crossing_and_an_exact_hit():
    points = curve([0.4, 0.7, 0.5, 0.9])  # crosses 0.6 between steps 0 and 10, falls back, crosses again
    assert speed.time_to(points, 0.6, "step") == (pytest.approx(20 / 3), False)
    assert speed.time_to(points, 0.7, "step") == (10.0, False)  # reached exactly at an evaluation
    assert speed.time_to(points, 0.4, "step") == (0.0, False)  # the warm start has it


@pytest.mark.parametrize("clock, end", [("step", 30.0), ("wall", 45.0), ("generated", 3000.0)])
def test_a_run_that_never_reaches_a_threshold_is_censored_at_its_end(clock, end):
    assert speed.time_to(curve([0.4, 0.5, 0.6, 0.55], step_s=1.5), 0.65, clock) == (end, True)


def test_area_up_to_a_budget_is_the_mean_accuracy_over_it():
    points = curve([0.0, 0.5, 1.0], step_s=5.0)  # linear from 0 at 0 s to 1 at 100 s
    assert speed.area(points, 50.0) == pytest.approx(0.25)
    assert speed.area(points, 100.0) == pytest.approx(0.5)
    # past the run's end the curve stays at its last value: (50 + 100) / 200
    assert speed.area(points, 200.0) == pytest.approx(0.75)
    assert speed.area(points, 75.0) == pytest.approx((0.5 * 75 * 0.75) / 75)  # a budget between evaluations


def test_accuracy_at_a_time_is_interpolated_and_held_after_the_end():
    points = curve([0.2, 0.4, 0.8])
    assert speed.value_at(points, "wall", 15.0) == pytest.approx(0.6)
    assert speed.value_at(points, "wall", 500.0) == pytest.approx(0.8)


@pytest.mark.parametrize(
    "final, expected",
    [(0.34, True), (0.35, False), (0.40, False)],  # warm start 0.45: collapsed only more than 0.1 below
)
def test_a_collapsed_run_ends_more_than_a_tenth_below_the_warm_start(final, expected):
    assert speed.collapsed(curve([0.45, 0.7, final]), 0.45) is expected
    assert not speed.collapsed(curve([0.45, 0.0, 0.45]), 0.45)  # a dip in the middle is no collapse


def test_thresholds_close_a_share_of_the_gap_to_one():
    assert speed.thresholds(0.6, [0.25, 0.5, 0.75]) == pytest.approx([0.7, 0.8, 0.9])


def test_the_learning_rate_is_chosen_by_area_not_by_final_accuracy():
    fast = [curve([0.4, 0.8, 0.8, 0.8])]  # up early, stays: area to 30 s = (0.6 * 10 + 0.8 * 20) / 30
    slow = [curve([0.4, 0.5, 0.6, 0.85])]  # ends higher, but late
    areas = {1e-4: [speed.area(c, 30.0) for c in slow], 2e-4: [speed.area(c, 30.0) for c in fast]}
    assert speed.choose_lr(areas) == 2e-4 and slow[0][-1]["greedy"] > fast[0][-1]["greedy"]
    assert speed.choose_lr({5e-5: [0.5, 0.7], 1e-4: [0.6, 0.6], 2e-4: [0.3, 0.2]}) == 5e-5  # equal means: lower rate


@pytest.mark.parametrize("values", [(10.0, 12.0, 14.0, 16.0), (3.0, 9.0), (1.0, 1.5, 7.0)])
def test_a_seed_mean_has_the_student_t_interval(values):
    from scipy import stats as scipy_stats

    interval = stats.t_mean([(v, False) for v in values])
    low, high = scipy_stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=scipy_stats.sem(values))
    assert (interval.point, interval.low, interval.high) == pytest.approx((np.mean(values), low, high))
    assert interval.bound == "="
    assert stats.t_mean([(5.0, False), (7.0, True)]).bound == ">="  # a censored seed: a lower bound


def test_a_ratio_is_of_geometric_means_with_a_welch_interval_on_the_log_scale():
    arm = [(v, False) for v in (10.0, 12.0, 14.0, 16.0)]
    base = [(v, False) for v in (20.0, 22.0, 26.0, 28.0, 30.0)]
    ratio = stats.log_ratio(arm, base)
    la, lb = np.log([v for v, _ in arm]), np.log([v for v, _ in base])
    va, vb = la.var(ddof=1) / 4, lb.var(ddof=1) / 5
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 4)  # Welch-Satterthwaite, brute force
    half = 2.0 * np.sqrt(va + vb)  # t(0.975, df) is above 2 for every df: the interval is at least this wide
    assert ratio.point == pytest.approx(np.exp(la.mean() - lb.mean()))
    assert ratio.low < ratio.point * np.exp(-half) and ratio.high > ratio.point * np.exp(half)
    from scipy import stats as scipy_stats

    t = scipy_stats.t.ppf(0.975, df)
    assert (ratio.low, ratio.high) == pytest.approx(
        (np.exp(la.mean() - lb.mean() - t * np.sqrt(va + vb)), np.exp(la.mean() - lb.mean() + t * np.sqrt(va + vb)))
    )
    same = stats.log_ratio([(5.0, False)] * 4, [(10.0, False)] * 4)
    assert (same.point, same.low, same.high) == pytest.approx((0.5, 0.5, 0.5)) and same.text() == "0.50 [0.50, 0.50]"


def test_one_seed_gives_a_point_without_an_interval():
    ratio = stats.log_ratio([(5.0, False)], [(10.0, False), (12.0, False)])
    assert ratio.point == pytest.approx(5.0 / np.sqrt(120.0)) and ratio.text() == "0.46 (one seed)"
    mean = stats.t_mean([(5.0, False)])
    assert math.isnan(mean.low) and stats.overlap(mean, stats.t_mean([(1.0, False), (2.0, False)])) == "unknown"


@pytest.mark.parametrize(
    "arm_censored, base_censored, bound, text",
    [
        (True, False, ">=", ">=0.71 ["),  # the arm never got there: its time, and the ratio, are lower bounds
        (False, True, "<=", "<=0.71 ["),  # the baseline never did: the ratio is an upper bound
        (True, True, "?", "- (censored in both)"),
    ],
)
def test_censored_seeds_bound_the_ratio(arm_censored, base_censored, bound, text):
    arm = [(10.0, False), (15.0, arm_censored), (10.0, False), (15.0, False)]
    base = [(20.0, False), (15.0, base_censored), (15.0, False), (20.0, False)]
    ratio = stats.log_ratio(arm, base)
    assert ratio.bound == bound and ratio.text().startswith(text)
    if bound != "?":
        assert (
            ratio.point == pytest.approx(np.sqrt(150.0) / np.sqrt(300.0)) and f"{bound}" in ratio.text().split("[")[1]
        )


def test_a_baseline_with_the_threshold_at_the_warm_start_has_no_ratio():
    ratio = stats.log_ratio([(5.0, False)], [(0.0, False)])
    assert math.isnan(ratio.point) and ratio.text() == "-"


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ((10, 12, "="), (11, 14, "="), "yes"),
        ((10, 12, "="), (13, 14, "="), "no"),
        ((10, 12, ">="), (5, 8, "="), "no"),  # the censored one is above already and can only move up
        ((10, 12, ">="), (11, 14, "="), "unknown"),
        ((5, 8, ">="), (10, 12, "="), "unknown"),  # below now, but it may move up into the other
        ((5, 8, ">="), (10, 12, ">="), "unknown"),
    ],
)
def test_whether_seed_mean_intervals_overlap(a, b, expected):
    first, second = (stats.Interval((x[0] + x[1]) / 2, x[0], x[1], x[2]) for x in (a, b))
    assert stats.overlap(first, second) == expected == stats.overlap(second, first)


# -- the analysis and the report on a synthetic study ------------------------------------------------------------------
WARM, LEVELS = 0.4, [0.55, 0.7, 0.85]
# arm -> (step seconds, {lr: (steps to the plateau, plateau)}, chosen rate); GRPO at 2e-4 collapses on seed 0
ARM_SHAPES = {
    "GRPO": (1.0, {5e-5: (150, 0.9), 1e-4: (60, 0.9), 2e-4: (30, 0.9)}, 1e-4),
    "GRPO+DF": (1.2, {5e-5: (100, 0.9), 1e-4: (50, 0.9), 2e-4: (40, 0.9)}, 2e-4),
    "PODS": (0.8, {5e-5: (40, 0.75), 1e-4: (40, 0.78), 2e-4: (40, 0.8)}, 2e-4),  # never reaches 0.85
    "D3S": (0.8, {5e-5: (120, 0.95), 1e-4: (60, 0.95), 2e-4: (30, 0.95)}, 2e-4),
}


def synthetic_run(arm, lr, seed, phase, steps=150, every=10, arms=ARM_SHAPES):
    step_s, shapes, _ = arms[arm]
    reach, top = shapes[lr]
    reach += 2 * seed  # a spread over seeds

    def greedy(step):
        value = WARM + (top - WARM) * min(1.0, step / reach)
        if arm == "GRPO" and lr == 2e-4 and seed == 0 and step > reach:  # falls to 0.2 by the end
            value = top - (top - 0.2) * (step - reach) / (steps - reach)
        return value

    points = [
        {"step": s, "wall": s * step_s, "generated": s * 100.0, "greedy": greedy(s)} for s in range(0, steps + 1, every)
    ]
    totals = {
        "steps": steps,
        "timing/step_total": step_s * steps,
        "timing/generation": step_s * 0.5 * steps,
        "timing/make_experience": step_s * 0.2 * steps,
        "timing/ppo_train": step_s * 0.25 * steps,
        "d3s/skipped_prompts": 3.0 * steps if arm == "D3S+history" else 0.0,
        "generated": 100.0 * steps,
    }
    return dict(
        task="pkg.toy_task",
        regime="fresh",
        arm=arm,
        lr=lr,
        seed=seed,
        phase=phase,
        date="2026-11-27",
        machine="test CPU, 2 CPUs",
        group=16,
        flags=[],
        process_seconds=200.0,
        eval_seconds=10.0,
        stopped=False,
        curve=points,
        totals=totals,
    )


def synthetic_runs(arms):
    runs = [synthetic_run(arm, lr, seed, "sweep", arms=arms) for seed in (0, 1) for arm in arms for lr in arms[arm][1]]
    return runs + [
        synthetic_run(arm, shape[2], seed, "study", arms=arms) for seed in (2, 3) for arm, shape in arms.items()
    ]


def synthetic_document():
    runs = synthetic_runs(ARM_SHAPES)
    return {
        "protocol": dict(
            quick=False, pool=200, steps=150, prompts_per_step=8, eval_every=10, fractions=[0.25, 0.5, 0.75]
        ),
        "tasks": {
            "pkg.toy_task": {
                "task_config": {"n_heldout": 256},
                "warm_start": {"greedy": WARM},
                "thresholds": LEVELS,
                "sft_seconds": 600.0,
                "date": "2026-11-26",
            }
        },
        "runs": runs,
    }


def test_the_analysis_of_a_synthetic_study():
    (analysed,) = speed.speed_analysis(synthetic_document())
    assert analysed["budget"] == pytest.approx(150.0) and analysed["reference_seeds"] == [0, 1]
    assert analysed["chosen"] == {arm: shape[2] for arm, shape in ARM_SHAPES.items()}
    assert [(c["arm"], c["lr"], c["seed"], c["phase"]) for c in analysed["collapses"]] == [("GRPO", 2e-4, 0, "sweep")]
    assert analysed["sweep"]["GRPO"][2e-4]["collapsed"] == [0]
    grpo, d3s, pods = (analysed["arms"][arm] for arm in ("GRPO", "D3S", "PODS"))
    assert grpo["seeds"] == [0, 1, 2, 3] and grpo["lr"] == 1e-4
    assert analysed["grpo_wall"] == pytest.approx(150.0)
    # to 0.55 (0.3 of the way to GRPO's plateau 0.9; 0.15 / 0.55 of D3S's to 0.95), over the geometric means of
    # the seeds' reaches, 60 + 2 x seed and 30 + 2 x seed steps
    ratio = d3s["ratios"]["GRPO"][0]["step"]
    reach = {
        arm: np.exp(np.mean(np.log([base + 2 * seed for seed in range(4)])))
        for arm, base in (("GRPO", 60), ("D3S", 30))
    }
    assert ratio.bound == "=" and ratio.point == pytest.approx((0.15 / 0.55 * reach["D3S"]) / (0.3 * reach["GRPO"]))
    assert d3s["ratios"]["GRPO"][0]["wall"].point == pytest.approx(ratio.point * 0.8)  # D3S's steps take 0.8 s
    assert d3s["overlap"]["GRPO"][0]["step"] == "no"
    # PODS never reaches 0.85: censored at its end (150 steps) on every seed, a lower bound
    assert pods["times"][2]["step"] == [(150.0, True)] * 4
    assert pods["ratios"]["GRPO"][2]["step"].bound == ">=" and pods["mean_times"][2]["wall"].bound == ">="
    assert pods["overlap"]["GRPO"][2]["step"] == "no"  # already above GRPO's, and it can only move up
    # D3S ended (120 s) before GRPO's 150 s: it keeps its final accuracy
    assert d3s["at_grpo_wall"] == pytest.approx([0.95] * 4)
    assert d3s["costs"] == pytest.approx(
        {
            "step": 0.8,
            "generation": 0.5,
            "experience": 0.2,
            "training": 0.25,
            "training_s": 0.2,
            "generation_s_per_mtoken": 0.4 / 100 * 1e6,
            "skipped": 0.0,
        }
    )
    assert set(grpo["ratios"]) == {"GRPO", "GRPO+DF"}
    # what limits the reading: D3S reaches 0.55 at its first evaluation on every seed (0.55-0.58 at step 10); the
    # rates chosen at 2e-4 are the sweep's highest
    assert d3s["first_evaluation"] == [4, 0, 0] and grpo["first_evaluation"] == [0, 0, 0]
    # on the study's seeds alone (2, 3): D3S to 0.55 in 0.8 s x 0.15 / 0.55 x (34, 36) steps, GRPO in 0.3 x (64, 66)
    assert d3s["study_seeds"] == [2, 3] and set(d3s["study_ratios"]) == {"GRPO", "GRPO+DF"}
    expected = 0.8 * 0.15 / 0.55 * np.sqrt(34 * 36) / (0.3 * np.sqrt(64 * 66))
    assert d3s["study_ratios"]["GRPO"][0].point == pytest.approx(expected)
    assert {arm: m["at_sweep_edge"] for arm, m in analysed["arms"].items()} == {
        "GRPO": False,
        "GRPO+DF": True,
        "PODS": True,
        "D3S": True,
    }


def test_what_limits_a_reading_crossings_at_the_first_evaluation_and_rates_at_the_sweeps_edge():
    rising = curve([0.6, 0.8], warm=0.4)
    assert speed.before_first_evaluation(rising, 0.5) and speed.before_first_evaluation(rising, 0.6)
    assert not speed.before_first_evaluation(rising, 0.7)  # reached between the first and second evaluations
    assert not speed.before_first_evaluation(rising, 0.3)  # held at the warm start
    assert not speed.before_first_evaluation(curve([0.4]), 0.5)  # no evaluation after the warm start
    assert speed.at_sweep_edge(5e-5, [5e-5, 1e-4, 2e-4]) and speed.at_sweep_edge(2e-4, [2e-4, 5e-5, 1e-4])
    assert not speed.at_sweep_edge(1e-4, [5e-5, 1e-4, 2e-4]) and not speed.at_sweep_edge(1e-4, [1e-4])


def test_an_arm_with_an_incomplete_sweep_chooses_no_rate():
    document = synthetic_document()
    document["runs"] = [  # GRPO+DF's sweep still lacks 2e-4 on seed 1, and its study
        run
        for run in document["runs"]
        if run["arm"] != "GRPO+DF" or (run["phase"] == "sweep" and (run["lr"], run["seed"]) != (2e-4, 1))
    ]
    (analysed,) = speed.speed_analysis(document)
    assert "GRPO+DF" not in analysed["chosen"] and "GRPO+DF" not in analysed["arms"]
    assert analysed["incomplete"] == {"GRPO+DF": [(2e-4, 1)]}
    assert set(analysed["arms"]["D3S"]["ratios"]) == {"GRPO"}  # no ratios to a baseline without a rate
    assert ratio_tables(speed.regime_lines(document, analysed, "###")) == ["GRPO"]


def ratio_tables(lines):
    """The bases of a section's ratio tables, in order."""
    return [line.split("**Ratios to ")[1].split("**")[0] for line in lines if line.startswith("**Ratios to ")]


def table(lines, head):
    """The rows of the first table after the line that starts with ``head``, as lists of cells."""
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # without the header and its rule


def test_the_speed_report_holds_the_analysis_numbers(tmp_path):
    path = tmp_path / "speed_study.json"
    document = synthetic_document()
    path.write_text(json.dumps(document))
    lines = Path(speed.speed_main(path, tmp_path / "speed.md")).read_text().splitlines()
    for name in ("speed_fresh.png", "speed_runs_fresh.png"):
        assert (tmp_path / name).exists() and any(line.endswith(f"]({name})") for line in lines)
    (analysed,) = speed.speed_analysis(document)
    assert [line for line in lines if line.startswith("#")] == [
        "# Speed to fixed accuracies",
        "## `toy_task`, one pass over fresh prompts",
    ]
    sweep = {row[0]: row[-1] for row in table(lines, "**Learning rates.**")}
    assert sweep == {arm: f"{lr:g}" for arm, lr in analysed["chosen"].items()}
    arms = table(lines, "**At the chosen rates.**")
    assert [(row[0], row[1], row[2]) for row in arms] == [
        (arm, f"{m['lr']:g}", "0, 1, 2, 3") for arm, m in analysed["arms"].items()
    ]
    times = table(lines, "**Time to each threshold**")
    assert len(times) == len(LEVELS) * len(ARM_SHAPES)
    pods_top = next(row for row in times if row[:2] == ["0.850", "PODS"])
    assert pods_top[2] == "4 of 4" and pods_top[3].startswith(">=")  # censored on every seed: a lower bound
    assert ratio_tables(lines) == ["GRPO", "GRPO+DF"]
    to_grpo = table(lines, "**Ratios to GRPO**")
    d3s = analysed["arms"]["D3S"]["ratios"]["GRPO"]
    assert [row[4] for row in to_grpo if row[1] == "D3S"] == [level["wall"].text() for level in d3s]
    assert all(row[1] != "GRPO" for row in to_grpo)
    collapses = next(line for line in lines if line.startswith("**Collapsed runs**"))
    assert "GRPO lr 0.0002 seed 0 (sweep): 0.200" in collapses


def test_an_arm_that_extends_another_is_compared_with_its_rerun_in_the_same_batch():
    document = synthetic_document()
    # D3S + history reaches D3S's plateau in half its steps at 0.7 s a step, in a later batch, where D3S, timed
    # again, takes 1.0 s a step instead of 0.8
    history = {"D3S+history": (0.7, {lr: (reach // 2, top) for lr, (reach, top) in ARM_SHAPES["D3S"][1].items()}, 2e-4)}
    document["runs"] += synthetic_runs(history)
    slower = {"D3S": (1.0, *ARM_SHAPES["D3S"][1:])}
    document["runs"] += [synthetic_run("D3S", 2e-4, seed, "rerun", arms=slower) for seed in (0, 1, 2, 3)]
    # and a rerun at a rate D3S did not choose, with the best curve of all: it must not move the choice
    best = {"D3S": (0.8, {5e-5: (5, 0.99)}, 5e-5)}
    document["runs"] += [synthetic_run("D3S", 5e-5, seed, "rerun", arms=best) for seed in (0, 1)]
    (analysed,) = speed.speed_analysis(document)
    assert analysed["chosen"]["D3S"] == 2e-4 and analysed["sweep"]["D3S"][5e-5]["seeds"] == [0, 1]
    arms = analysed["arms"]
    assert arms["D3S"]["costs"]["step"] == pytest.approx(0.8)  # the study's runs, without the reruns
    assert arms["D3S rerun"]["costs"]["step"] == pytest.approx(1.0)
    assert set(arms["D3S+history"]["ratios"]) == {"GRPO", "GRPO+DF", "D3S", "D3S rerun"}
    assert set(arms["D3S rerun"]["ratios"]) == {"GRPO", "GRPO+DF", "D3S"}  # a rerun: divided by the arm it times
    assert set(arms["D3S"]["ratios"]) == {"GRPO", "GRPO+DF"}
    assert arms["D3S+history"]["costs"]["skipped"] == pytest.approx(3.0)
    # to 0.55: D3S + history crosses at 0.15 / 0.55 of half D3S's reach (30 + 2 x seed steps; 15 + 2 x seed)
    to_d3s = arms["D3S+history"]["ratios"]["D3S"][0]
    gmean = lambda values: np.exp(np.mean(np.log(values)))  # noqa: E731
    assert to_d3s["step"].point == pytest.approx(gmean([15, 17, 19, 21]) / gmean([30, 32, 34, 36]))
    assert to_d3s["wall"].point == pytest.approx(to_d3s["step"].point * 0.7 / 0.8)
    to_rerun = arms["D3S+history"]["ratios"]["D3S rerun"][0]["wall"]
    assert to_rerun.point == pytest.approx(to_d3s["step"].point * 0.7 / 1.0)
    lines = speed.regime_lines(document, analysed, "###")
    assert ratio_tables(lines) == ["GRPO", "GRPO+DF", "D3S rerun", "D3S"]
    assert [row[1] for row in table(lines, "**Ratios to D3S rerun**")] == ["D3S+history"] * len(LEVELS)
    assert {row[1] for row in table(lines, "**Ratios to D3S**")} == {"D3S+history", "D3S rerun"}
    skipped = next(line for line in lines if line.startswith("**Prompts skipped**"))
    assert skipped.endswith("D3S+history 3.0.")
    (head,) = speed.head_lines(document, [analysed], 1)
    assert f"D3S+history to D3S rerun {to_rerun.text()}" in head and "D3S rerun to" not in head


def test_results_md_opens_with_what_stands_then_numbered_sections(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in ("selection.json", "step_cost.json"):
        (results / name).write_text((BENCHMARKS / "results" / name).read_text())
    report.main(["--results", str(results), "--output", str(tmp_path / "RESULTS.md")])
    text = (tmp_path / "RESULTS.md").read_text()
    section = text.split("## 1. Speed to fixed accuracies")[1].split("\n## ")[0]
    assert "`.venv/bin/python benchmarks/bench_speed.py" in section  # not run: the section says how to run it
    (results / "speed_study.json").write_text(json.dumps(synthetic_document()))
    report.main(["--results", str(results), "--output", str(tmp_path / "RESULTS.md")])
    lines = (tmp_path / "RESULTS.md").read_text().splitlines()
    numbers = [int(line[3:].split(".")[0]) for line in lines if line.startswith("## ")]
    assert numbers[:3] == [1, 2, 3] and numbers == sorted(set(numbers))  # a section not run yet leaves a gap
    head = lines[: lines.index(next(line for line in lines if line.startswith("## 1. ")))]
    assert len(head) <= 40
    assert "](results/speed_study_fresh.png)" in "\n".join(lines) and (results / "speed_study_fresh.png").exists()
    (speed_line,) = [line for line in head if line.startswith("- Speed (section 1)")]
    arms = speed.speed_analysis(synthetic_document())[0]["arms"]
    assert "seeds 2, 3 (no part in choosing a rate):" in speed_line  # the headline: seeds that chose nothing
    for arm in ("GRPO+DF", "PODS", "D3S"):
        assert f"{arm} to GRPO " + " / ".join(r.text() for r in arms[arm]["study_ratios"]["GRPO"]) in speed_line
    faster = [arm for arm, m in arms.items() if arm != "GRPO" and all(r.high < 1 for r in m["study_ratios"]["GRPO"])]
    assert faster == ["D3S"] and f"below 1): {', '.join(faster)};" in speed_line
    report.main(["--speed", str(results / "speed_study.json"), "--output", str(tmp_path / "alone.md")])
    assert (tmp_path / "alone.md").read_text().splitlines()[0] == "# Speed to fixed accuracies"


def test_the_committed_results_md_is_what_report_py_writes(tmp_path):
    """RESULTS.md is regenerated from the JSON: the committed one is report.py's output (its plots go to a copy)."""
    results = tmp_path / "results"
    results.mkdir()
    for path in (BENCHMARKS / "results").glob("*.json"):
        (results / path.name).write_text(path.read_text())
    report.main(["--results", str(results), "--output", str(tmp_path / "RESULTS.md")])
    assert (tmp_path / "RESULTS.md").read_text() == (BENCHMARKS / "RESULTS.md").read_text()


# -- the runner: appending seed by seed, resuming, the study at the chosen rates -----------------------------------
class FakeLauncher:
    """bench_speed.run and prepare_task without Ray: GRPO learns best at 1e-4, D3S at 2e-4; the ``fail_at``-th
    run raises (a run cut off); GRPO at 5e-5 on ``stop_seed`` is stopped at the run cap after half its steps."""

    PEAK = {"GRPO": 1e-4, "D3S": 2e-4}

    def __init__(self, fail_at=None):
        self.calls, self.fail_at, self.warm_starts, self.stop_seed = [], fail_at, 0, None
        self.workdirs = []
        self.weights, self.greedy = b"sft weights", 0.1  # what a warm start made now holds, and scores

    def run(self, prepared, task, arm, seed, workdir, steps, eval_every, samples, prompts, fp32, **kw):
        self.calls.append((kw["regime"], arm, kw["lr"], seed))
        self.workdirs.append(Path(workdir))
        assert samples == 0 and kw["cap"] > 0
        if len(self.calls) == self.fail_at:
            raise RuntimeError("run failed")
        stopped = (arm, kw["lr"], seed) == ("GRPO", 5e-5, self.stop_seed)
        steps = steps // 2 if stopped else steps
        top = 0.9 if kw["lr"] == self.PEAK[arm] else 0.6
        logged = [
            {
                "step": s + 1,
                "timing/step_total": 1.0,
                "timing/generation": 0.5,
                "timing/make_experience": 0.2,
                "timing/ppo_train": 0.25,
                "timing/broadcast": 0.05,
                "rollout/reward_mean": 0.5,
                "rollout/response_length_mean": 20.0,
                "rollout/num_samples": 128,
            }
            for s in range(steps)
        ]
        heldout = [{"step": s, "greedy": top * s / steps} for s in range(eval_every, steps + 1, eval_every)]
        return {
            "group": 16,
            "steps": logged,
            "heldout": heldout,
            "process_seconds": 50.0,
            "eval_seconds": 2.0,
            "stopped": stopped,
        }

    def prepare_task(self, task, precision, config, workdir, split):
        """The warm start made once per ``workdir`` (SFT seconds the first time, None when reused)."""
        from d3s_openrlhf.testbed import pipeline

        files = pipeline.TaskFiles(sft="sft.jsonl", prompts="prompts.jsonl", heldout="heldout.jsonl")
        made = Path(workdir, f"task{split}")
        seconds = None if made.exists() else 1.0
        (made / "sft").mkdir(parents=True, exist_ok=True)
        if seconds is not None:
            (made / "sft" / "model.safetensors").write_bytes(self.weights)
        return pipeline.Prepared(base_model="base", sft_model=str(made / "sft"), task=files), seconds

    def heldout_accuracy(self, *args, **kwargs):
        self.warm_starts += 1
        return {"greedy": self.greedy}


@pytest.fixture
def launcher(monkeypatch):
    fake = FakeLauncher()
    monkeypatch.setattr(bench_speed, "run", fake.run)
    monkeypatch.setattr(bench_speed, "prepare_task", fake.prepare_task)
    monkeypatch.setattr(bench_speed.evaluate, "heldout_accuracy", fake.heldout_accuracy)
    return fake


def speed_argv(tmp_path, *more):
    flags = ["--tasks", "d3s_openrlhf.tasks.chainsum", "--regimes", "fresh", "--arms", "GRPO", "D3S", "--steps", "4"]
    flags += ["--lrs", "5e-5", "1e-4", "2e-4", "--eval-every", "2"]
    return ["--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "runs"), *flags, *more]


def test_the_runner_appends_each_run_and_resumes_where_it_stopped(tmp_path, launcher):
    launcher.fail_at = 5
    with pytest.raises(RuntimeError, match="run failed"):
        bench_speed.main(speed_argv(tmp_path))
    path = tmp_path / "out" / "speed_study.json"
    document = json.loads(path.read_text())
    assert len(document["runs"]) == 4  # the four runs before the failure were kept
    # seed-major: seed 0's arms and rates first; GRPO's three rates, then D3S's
    assert [(r["arm"], r["lr"], r["seed"]) for r in document["runs"]][:4] == [
        ("GRPO", 5e-5, 0),
        ("GRPO", 1e-4, 0),
        ("GRPO", 2e-4, 0),
        ("D3S", 5e-5, 0),
    ]
    assert document["tasks"]["d3s_openrlhf.tasks.chainsum"]["thresholds"] == pytest.approx([0.325, 0.55, 0.775])
    first = document["runs"][0]
    assert [p["step"] for p in first["curve"]] == [0, 2, 4] and first["curve"][0]["greedy"] == 0.1
    assert first["curve"][-1]["wall"] == 4.0 and first["curve"][-1]["generated"] == 4 * 20.0 * 128
    assert first["totals"] == {
        "steps": 4,
        "timing/step_total": 4.0,
        "timing/generation": 2.0,
        "timing/make_experience": 0.8,
        "timing/ppo_train": 1.0,
        "d3s/skipped_prompts": 0.0,
        "generated": 4 * 20.0 * 128,
    }
    assert first["phase"] == "sweep" and not first["stopped"]

    launcher.calls.clear()
    launcher.fail_at = None
    bench_speed.main(speed_argv(tmp_path))  # the same command: the rest of the sweep, then the study
    sweep = [(a, lr, s) for _, a, lr, s in launcher.calls if s in (0, 1)]
    assert sweep[0] == ("D3S", 1e-4, 0) and len(sweep) == 2 * 3 * 2 - 4  # the failed run again; nothing twice
    study = [(a, lr, s) for _, a, lr, s in launcher.calls if s in (2, 3)]
    assert study == [("GRPO", 1e-4, 2), ("D3S", 2e-4, 2), ("GRPO", 1e-4, 3), ("D3S", 2e-4, 3)]
    document = json.loads(path.read_text())
    assert len(document["runs"]) == 16 and {r["phase"] for r in document["runs"] if r["seed"] > 1} == {"study"}
    assert launcher.warm_starts == 1  # the warm start and its thresholds were set once, before the first run
    report.main(["--speed", str(path), "--output", str(tmp_path / "out" / "speed_study.md")])  # the report reads it
    assert (tmp_path / "out" / "speed_study_fresh.png").exists()

    launcher.calls.clear()
    bench_speed.main(speed_argv(tmp_path))
    assert launcher.calls == []
    with pytest.raises(SystemExit, match="holds a study with steps 4; give another --out"):
        bench_speed.main(speed_argv(tmp_path, "--steps", "6"))


def test_a_warm_start_made_anew_is_taken_only_if_it_reproduces_the_runs(tmp_path, launcher):
    """A fresh machine or another --workdir makes the SFT again: its runs go on where its weights are those of the
    recorded runs (or, in a study recorded before the digest was kept, its held-out accuracy theirs); the thresholds
    stay the recorded ones."""
    argv = speed_argv(tmp_path, "--arms", "GRPO", "--sweep-seeds", "0", "--seeds")
    bench_speed.main(argv)
    path = tmp_path / "out" / "speed_study.json"
    task = "d3s_openrlhf.tasks.chainsum"
    recorded = json.loads(path.read_text())["tasks"][task]
    assert recorded["sft_digest"] == hashlib.sha256(b"sft weights").hexdigest()
    bench_speed.main([*argv, "--workdir", str(tmp_path / "again"), "--lrs", "2.5e-5", "2e-4"])  # the same weights
    document = json.loads(path.read_text())
    assert launcher.warm_starts == 1 and len(document["runs"]) == 4
    assert document["tasks"][task]["thresholds"] == recorded["thresholds"]
    assert document["tasks"][task]["sft_remade"] == [dict(date=time.strftime("%Y-%m-%d"), sft_seconds=1.0)]
    launcher.weights = b"other weights"
    with pytest.raises(SystemExit, match="from another warm start than the one in .*elsewhere.*differ"):
        bench_speed.main([*argv, "--workdir", str(tmp_path / "elsewhere")])
    with pytest.raises(SystemExit, match="differ"):  # found there the second time: refused all the same
        bench_speed.main([*argv, "--workdir", str(tmp_path / "elsewhere")])

    document = json.loads(path.read_text())
    del document["tasks"][task]["sft_digest"]  # a study recorded before the digest: the accuracy decides
    path.write_text(json.dumps(document))
    launcher.greedy = 0.2
    for _ in range(2):  # made, then found: evaluated both times
        with pytest.raises(SystemExit, match="differ"):
            bench_speed.main([*argv, "--workdir", str(tmp_path / "third")])
    launcher.greedy = 0.1
    bench_speed.main([*argv, "--workdir", str(tmp_path / "fourth")])
    entry = json.loads(path.read_text())["tasks"][task]
    assert entry["sft_digest"] == hashlib.sha256(b"other weights").hexdigest()
    assert entry["warm_start"] == {"greedy": 0.1} and entry["thresholds"] == recorded["thresholds"]

    del document["tasks"][task]  # runs without their warm start and thresholds
    path.write_text(json.dumps(document))
    with pytest.raises(SystemExit, match="not their warm start and thresholds"):
        bench_speed.main(argv)


def test_before_the_first_run_another_warm_start_replaces_the_recorded_one(tmp_path, launcher):
    """No run reads the thresholds yet: a warm start made anew, or found changed in the workdir, is evaluated and
    sets them; one found unchanged is not evaluated again."""
    argv = speed_argv(tmp_path, "--arms", "GRPO", "--phases", "study", "--seeds")
    path, task = tmp_path / "out" / "speed_study.json", "d3s_openrlhf.tasks.chainsum"
    bench_speed.main(argv)
    bench_speed.main(argv)
    assert launcher.warm_starts == 1 and json.loads(path.read_text())["runs"] == []
    (weights,) = (tmp_path / "runs").rglob("model.safetensors")
    weights.write_bytes(b"changed")
    launcher.greedy = 0.5
    bench_speed.main(argv)
    entry = json.loads(path.read_text())["tasks"][task]
    assert launcher.warm_starts == 2 and entry["sft_digest"] == hashlib.sha256(b"changed").hexdigest()
    assert entry["thresholds"] == pytest.approx([0.625, 0.75, 0.875])
    launcher.weights = b"new"
    bench_speed.main([*argv, "--workdir", str(tmp_path / "fresh")])
    assert launcher.warm_starts == 3 and "sft_remade" not in json.loads(path.read_text())["tasks"][task]


def test_a_run_stopped_at_the_cap_is_kept_and_reported(tmp_path, launcher):
    launcher.stop_seed = 1
    bench_speed.main(speed_argv(tmp_path, "--steps", "8", "--run-cap", "60"))
    document = json.loads((tmp_path / "out" / "speed_study.json").read_text())
    (stopped,) = [run for run in document["runs"] if run["stopped"]]
    assert (stopped["arm"], stopped["lr"], stopped["seed"]) == ("GRPO", 5e-5, 1)
    assert stopped["totals"]["steps"] == 4 and stopped["curve"][-1]["step"] == 4
    (analysed,) = speed.speed_analysis(document)
    assert analysed["stopped"] == [dict(arm="GRPO", lr=5e-5, seed=1, phase="sweep", steps=4)]


def test_the_study_waits_for_a_complete_sweep(tmp_path, launcher):
    bench_speed.main(speed_argv(tmp_path, "--arms", "GRPO", "--phases", "sweep", "--sweep-seeds", "0"))
    with pytest.raises(SystemExit, match=r"needs its sweep first \(--phases sweep\); missing: D3S lr 5e-05 seed 0"):
        bench_speed.main(speed_argv(tmp_path, "--phases", "study", "--sweep-seeds", "0"))


def test_a_rerun_times_an_arm_again_at_its_chosen_rate_and_is_kept_apart(tmp_path, launcher):
    bench_speed.main(speed_argv(tmp_path))
    launcher.calls.clear()
    rerun = speed_argv(tmp_path, "--arms", "D3S", "--phases", "rerun", "--rerun-seeds", "0", "1")
    bench_speed.main(rerun)
    assert launcher.calls == [("fresh", "D3S", 2e-4, 0), ("fresh", "D3S", 2e-4, 1)]  # D3S's chosen rate, again
    assert [w.name for w in launcher.workdirs[-2:]] == ["rerun", "rerun"]  # the study's logs stay
    document = json.loads((tmp_path / "out" / "speed_study.json").read_text())
    assert [(r["arm"], r["lr"], r["seed"]) for r in document["runs"] if r["phase"] == "rerun"] == [
        ("D3S", 2e-4, 0),
        ("D3S", 2e-4, 1),
    ]
    launcher.calls.clear()
    bench_speed.main(rerun)  # recorded: nothing runs twice
    assert launcher.calls == []
    (analysed,) = speed.speed_analysis(document)
    assert analysed["arms"]["D3S rerun"]["seeds"] == [0, 1] and analysed["arms"]["D3S"]["seeds"] == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="needs its sweep first"):  # a rerun needs a chosen rate
        bench_speed.main(speed_argv(tmp_path, "--phases", "rerun", "--lrs", "2.5e-5", "2e-4"))


def test_the_fixed_rate_phase_runs_every_arm_at_one_rate_without_a_sweep(tmp_path, launcher):
    argv = speed_argv(tmp_path, "--name", "equal_updates", "--phases", "fixed-rate", "--fixed-lr", "1e-4")
    bench_speed.main([*argv, "--seeds", "4", "5", "--eval-early", "2", "2"])
    assert launcher.calls == [("fresh", arm, 1e-4, seed) for seed in (4, 5) for arm in ("GRPO", "D3S")]
    assert not (tmp_path / "out" / "speed_study.json").exists()
    document = json.loads((tmp_path / "out" / "equal_updates.json").read_text())
    assert {run["phase"] for run in document["runs"]} == {"fixed-rate"}
    assert document["protocol"]["eval_early"] == [2, 2] and document["protocol"]["micro_batch"] == 32
    (analysed,) = speed.speed_analysis(document)
    assert analysed["chosen"] == {} and analysed["fixed"] == {"GRPO": 1e-4, "D3S": 1e-4}
    d3s = analysed["arms"]["D3S"]
    assert d3s["lr"] == 1e-4 and d3s["seeds"] == d3s["study_seeds"] == [4, 5] and set(d3s["ratios"]) == {"GRPO"}
    text = "\n".join(speed.speed_body(document, [analysed], {}, name="equal_updates"))
    assert "No sweep: every arm at lr 0.0001" in text and "every arm at the one rate given" in text
    command = (
        "bench_speed.py --name equal_updates --tasks d3s_openrlhf.tasks.chainsum --regimes fresh --phases fixed-rate "
        "--fixed-lr 0.0001 --seeds 4 5 --eval-early 2 2 --micro-batch 32 --arms GRPO D3S`"
    )
    assert command in text
    assert "and every 2 up to step 2" in text and "on the study's seeds alone" not in text  # no seed chose a rate
    launcher.calls.clear()
    bench_speed.main([*argv, "--seeds", "4", "5", "--eval-early", "2", "2"])  # recorded: nothing runs twice
    assert launcher.calls == []
    with pytest.raises(SystemExit, match="holds a study with eval_early"):
        bench_speed.main([*argv, "--seeds", "6"])


def test_a_sweep_beside_the_fixed_rate_runs_reuses_them_where_it_chose_their_rate(tmp_path, launcher):
    fixed = speed_argv(tmp_path, "--name", "equal_updates", "--phases", "fixed-rate", "--fixed-lr", "1e-4")
    bench_speed.main([*fixed, "--seeds", "4", "5"])
    sweep = speed_argv(tmp_path, "--name", "equal_updates", "--phases", "sweep", "--sweep-seeds", "0")
    bench_speed.main(sweep)
    launcher.calls.clear()
    bench_speed.main(
        [*sweep[: sweep.index("--phases")], "--phases", "study", "--sweep-seeds", "0", "--seeds", "4", "5"]
    )
    document = json.loads((tmp_path / "out" / "equal_updates.json").read_text())
    (analysed,) = speed.speed_analysis(document)
    chosen = analysed["chosen"]
    assert set(chosen) == {"GRPO", "D3S"} and analysed["fixed"] == {}
    # a chosen rate's study seeds are the fixed-rate runs where it is the rate given, new study runs elsewhere
    assert launcher.calls == [("fresh", arm, chosen[arm], s) for s in (4, 5) for arm in chosen if chosen[arm] != 1e-4]
    for arm, m in analysed["arms"].items():
        assert m["lr"] == chosen[arm] and m["seeds"] == [0, 4, 5] and m["study_seeds"] == [4, 5]
    text = "\n".join(speed.speed_body(document, [analysed], {}, name="equal_updates"))
    assert "GRPO, D3S each at the rate its sweep chose" in text
    for command in (
        "--phases fixed-rate --fixed-lr 0.0001 --seeds 4 5 --micro-batch 32 --arms GRPO D3S`",
        "--phases sweep --lrs 5e-05 0.0001 0.0002 --sweep-seeds 0 --micro-batch 32 --arms GRPO D3S`",
    ):
        assert command in text, command
    study_runs = [run for run in document["runs"] if run["phase"] == "study"]
    assert ("--phases study" in text) == bool(study_runs)


def test_each_task_and_regime_at_its_own_given_rate_has_its_own_command(tmp_path, launcher):
    fixed = speed_argv(tmp_path, "--name", "equal_updates", "--phases", "fixed-rate", "--seeds", "4", "--pool", "16")
    bench_speed.main([*fixed, "--fixed-lr", "1e-4"])
    passes = [*fixed, "--fixed-lr", "5e-5"]
    passes[passes.index("fresh")] = "passes"
    bench_speed.main(passes)
    document = json.loads((tmp_path / "out" / "equal_updates.json").read_text())
    analyses = speed.speed_analysis(document)
    assert [(a["regime"], a["fixed"]) for a in analyses] == [
        ("fresh", {"GRPO": 1e-4, "D3S": 1e-4}),
        ("passes", {"GRPO": 5e-5, "D3S": 5e-5}),
    ]
    text = "\n".join(speed.speed_body(document, analyses, {}, name="equal_updates"))
    for regime, lr in (("fresh", "0.0001"), ("passes", "5e-05")):
        assert f"--regimes {regime} --phases fixed-rate --fixed-lr {lr} --seeds 4 --micro-batch 32" in text, regime


def test_a_document_from_before_the_new_protocol_keys_resumes_with_their_old_values(tmp_path, launcher):
    bench_speed.main(speed_argv(tmp_path, "--phases", "sweep", "--sweep-seeds", "0", "--arms", "GRPO"))
    path = tmp_path / "out" / "speed_study.json"
    document = json.loads(path.read_text())
    for key in bench_speed.LEGACY_PROTOCOL:
        del document["protocol"][key]
    path.write_text(json.dumps(document))
    launcher.calls.clear()
    bench_speed.main(speed_argv(tmp_path, "--phases", "sweep", "--sweep-seeds", "0", "1", "--arms", "GRPO"))
    assert [seed for *_, seed in launcher.calls] == [1, 1, 1]
    with pytest.raises(SystemExit, match="holds a study with micro_batch 32"):
        bench_speed.main(speed_argv(tmp_path, "--micro-batch", "8"))


def test_an_arm_lacking_a_rate_another_arm_swept_waits_for_it(tmp_path, launcher):
    bench_speed.main(speed_argv(tmp_path, "--phases", "sweep", "--sweep-seeds", "0"))
    bench_speed.main(speed_argv(tmp_path, "--arms", "GRPO", "--lrs", "2.5e-5", "2e-4", "--sweep-seeds", "0"))
    # D3S has every rate of its own --lrs, but not GRPO's 2.5e-5: the report would choose no rate for it
    with pytest.raises(SystemExit, match=r"needs its sweep first \(--phases sweep\); missing: D3S lr 2.5e-05 seed 0"):
        bench_speed.main(speed_argv(tmp_path, "--arms", "D3S", "--phases", "study", "--sweep-seeds", "0"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lrs", "1e-4", "4e-4"], "--lrs must include 0.0002"),
        (["--seeds", "1", "2"], "must differ"),
        (["--regimes", "passes", "--pool", "12"], "--pool 12 must be a multiple of --prompts 8"),
        (["--phases", "fixed-rate"], "--phases fixed-rate and --fixed-lr go together"),
        (["--fixed-lr", "1e-4"], "--phases fixed-rate and --fixed-lr go together"),
        (["--eval-early", "4", "2"], "EVERY must be positive and at most UNTIL"),
        (["--eval-early", "3", "9"], "--eval-every 2 must be a multiple of --eval-early's EVERY 3"),
    ],
)
def test_bad_options_are_refused_before_any_run(tmp_path, launcher, flags, message):
    with pytest.raises(SystemExit, match=message):
        bench_speed.main(speed_argv(tmp_path, *flags))
    assert launcher.calls == [] and not (tmp_path / "out").exists()


def test_each_task_runs_its_own_regimes():
    options = bench_speed.parse_options([])
    assert [bench_speed.regimes_of(options, task) for task in options.tasks] == [["passes", "fresh"], ["fresh"]]
    assert options.arms == ["GRPO", "GRPO+DF", "PODS", "D3S", "D3S-I"] and options.lrs == [2.5e-5, 5e-5, 1e-4, 2e-4]
    assert max(options.lrs) / min(options.lrs) >= 4 and options.heldout >= 256
    assert options.steps // options.eval_every == 15


def test_every_total_the_study_keeps_is_read_from_the_runs():
    # a total missing from the keys read off a run's events would be 0 in the JSON without a word
    assert set(bench_speed.SUMMED) <= set(bench_speed.KEYS)


def stand_in_prepared():
    """A warm start's paths, as bench_speed.run and rl_config read them (nothing on disk)."""
    from d3s_openrlhf.testbed import pipeline

    files = pipeline.TaskFiles(sft="sft.jsonl", prompts="prompts.jsonl", heldout="heldout.jsonl")
    return pipeline.Prepared(base_model="base", sft_model="sft", task=files, reward_file="r.py")


def arm_command(arm, pool, micro_batch, tmp_path):
    """``(config, argv)``: the run of ``arm`` at lr 1e-4 over ``pool`` prompts, as bench_speed.run launches it."""
    from d3s_openrlhf.testbed import pipeline

    prepared = stand_in_prepared()
    config = bench_speed.rl_config(prepared, arm, 0, 150, 10, 8, True, pool, 1e-4, micro_batch)
    return config, [str(flag) for flag in pipeline.ppo_args("sft", prepared.task, str(tmp_path), config)]


@pytest.mark.parametrize("regime, pool", [("passes", 200), ("fresh", 4000)])
@pytest.mark.parametrize("micro_batch", [bench_speed.MICRO_BATCH, 8])
def test_every_arm_trains_the_same_steps(regime, pool, micro_batch, tmp_path):
    from d3s_openrlhf.cli.train_ppo_ray import resolve
    from d3s_openrlhf.integration import host

    for arm in bench_speed.ARMS:
        config, argv = arm_command(arm, pool, micro_batch, tmp_path)
        assert argv[argv.index("--actor.adam.lr") + 1] == "0.0001"
        assert argv[argv.index("--train.micro_batch_size") + 1] == str(micro_batch)
        d3s, _, host_args, _ = resolve(argv)
        fixed = host.fixed_steps(d3s, host_args)
        if bench_speed.drops_prompts(arm):  # its fixed steps, over the pool cycled as it needs
            assert fixed == 150 and config.steps * config.prompts_per_step == pool, arm
        else:  # upstream's passes: whole ones over the pool, or one pass over fresh prompts
            assert fixed is None and config.steps * config.episodes == 150, arm
            assert config.steps * config.prompts_per_step == min(pool, 150 * 8), arm
            assert host.rollout_steps(config.steps * config.prompts_per_step, host_args) == 150


def plan(arm, micro_batch, tmp_path):
    """The D3S plan (kept rollouts and optimizer steps per N) of ``arm`` in the study's fresh regime."""
    from d3s_openrlhf.cli.train_ppo_ray import resolve

    return resolve(arm_command(arm, 4000, micro_batch, tmp_path)[1])[3]


@pytest.mark.parametrize("arm", ["PODS", "D3S", "D3S-I"])
def test_fixed_updates_changes_the_optimizer_steps_alone(arm, tmp_path):
    """At micro-batches of 8, the arm with fixed updates keeps what the arm keeps and takes GRPO's 4 optimizer
    steps per rollout step; at 32 each of its 4 optimizer batches would be a whole micro-batch of 32, so it would
    keep every rollout (the study runs --micro-batch 8)."""
    base, fixed, grpo = (plan(name, 8, tmp_path) for name in (arm, f"{arm}+fixed-updates", "GRPO"))
    assert bench_speed.ARMS[f"{arm}+fixed-updates"][1] == [*bench_speed.ARMS[arm][1], *bench_speed.FIXED_UPDATES]
    assert fixed.kept_by_n == base.kept_by_n and set(base.kept_by_n.values()) != {128}
    assert set(fixed.updates_by_n.values()) == set(grpo.updates_by_n.values()) == {4}
    assert max(base.updates_by_n.values()) < 4
    assert set(plan(f"{arm}+fixed-updates", bench_speed.MICRO_BATCH, tmp_path).kept_by_n.values()) == {128}


def test_grpo_with_half_its_batch_takes_twice_its_updates(tmp_path):
    assert bench_speed.ARMS["GRPO+half-batch"][1] == [*bench_speed.ARMS["GRPO"][1], *bench_speed.HALF_BATCH]
    assert set(plan("GRPO+half-batch", 8, tmp_path).updates_by_n.values()) == {8}


@pytest.mark.parametrize(
    "steps, every, early, expected",
    [
        (150, 10, None, list(range(10, 151, 10))),
        (150, 10, (2, 20), [*range(2, 21, 2), *range(30, 151, 10)]),
        (7, 10, None, [7]),  # the final model alone
        (9, 4, (2, 5), [2, 4, 8, 9]),
    ],
)
def test_the_evaluated_steps(steps, every, early, expected):
    assert bench_speed.evaluated_steps(steps, every, early) == expected


def test_the_arms_generate_and_train_as_published():
    grpo, pods, d3s, d3s_i = (bench_speed.ARMS[arm] for arm in ("GRPO", "PODS", "D3S", "D3S-I"))
    assert {group for group, _ in bench_speed.ARMS.values()} == {bench_speed.G}
    flags = [str(flag) for flag in pods[1]]
    assert flags[flags.index("--d3s.n_init") + 1] == str(bench_speed.PODS_M)  # PODS trains m of its n = G
    assert [str(flag) for flag in grpo[1]].count(str(bench_speed.G)) == 2  # GRPO: N = G, nothing dropped
    assert d3s[1][2:] == d3s_i[1][2:] and (d3s[1][1], d3s_i[1][1]) == ("d3s", "d3s-i")  # only the scope differs
    assert bench_speed.ARMS["D3S+history"][1] == [*d3s[1], *bench_speed.HISTORY]


def log_steps(monkeypatch, steps):
    """A run's events: ``steps`` logged steps."""
    monkeypatch.setattr(
        bench_speed, "read_train_scalars", lambda path: {s: {"rollout/num_samples": 128} for s in range(1, steps + 1)}
    )


def record_evaluations(monkeypatch):
    """The names of the models bench_speed.run evaluates, in order (each scores 0)."""
    evaluated = []
    monkeypatch.setattr(
        bench_speed.evaluate,
        "heldout_accuracy",
        lambda path, heldout, **kw: evaluated.append(Path(path).name) or {"greedy": 0.0},
    )
    return evaluated


@pytest.mark.parametrize("cap", [60.0, 900.0])
def test_a_run_past_its_cap_is_kept_with_what_it_saved(cap, tmp_path, monkeypatch):
    """A run still going at ``cap`` is stopped and kept: its logged steps and the checkpoints saved before its last
    logged step (one of that step may be cut off mid-write), no final model."""
    from d3s_openrlhf.testbed import pipeline

    workdir = tmp_path / "runs"

    def stalled(command, log, timeout=None):
        assert timeout == cap
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
    log_steps(monkeypatch, 3)
    evaluated = record_evaluations(monkeypatch)
    result = bench_speed.run(
        stand_in_prepared(), "pkg.task", "GRPO+DF", 0, str(workdir), 4, 2, 0, 8, True, "fresh", 4000, 2e-4, cap
    )
    assert result["stopped"] and len(result["steps"]) == 3
    assert evaluated == ["global_step2_hf"] and [e["step"] for e in result["heldout"]] == [2]


def test_a_run_saves_at_the_early_interval_and_evaluates_the_schedule_alone(tmp_path, monkeypatch):
    """With --eval-early 2 4 and --eval-every 4 over 8 steps, checkpoints are saved every 2 steps and the models of
    steps 2, 4 and the final one (8) are evaluated; step 6's is deleted unread, with the others."""
    from d3s_openrlhf.testbed import pipeline

    workdir, configs = tmp_path / "runs", []
    run_dir = workdir / "speed-fresh-GRPO-lr0.0002-seed0"

    def finished(command, log, timeout=None):
        for step in (2, 4, 6, 8):
            (run_dir / "checkpoints" / f"global_step{step}_hf").mkdir(parents=True)
        (run_dir / "final_model").mkdir()
        return 0

    monkeypatch.setattr(pipeline, "run_logged", finished)
    monkeypatch.setattr(pipeline, "launcher_command", lambda *args: ["train"])
    monkeypatch.setattr(pipeline, "ppo_args", lambda model, task, out, config: configs.append(config) or [])
    log_steps(monkeypatch, 8)
    evaluated = record_evaluations(monkeypatch)
    result = bench_speed.run(
        stand_in_prepared(),
        "pkg.task",
        "GRPO",
        0,
        str(workdir),
        8,
        4,
        0,
        8,
        True,
        "fresh",
        4000,
        2e-4,
        900.0,
        (2, 4),
        8,
    )
    (config,) = configs
    extra = [str(flag) for flag in config.extra]
    assert extra[extra.index("--ckpt.save_steps") + 1] == "2" and config.micro_batch_size == 8
    assert evaluated == ["global_step2_hf", "global_step4_hf", "final_model"]
    assert [e["step"] for e in result["heldout"]] == [2, 4, 8]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "final_model").exists()
