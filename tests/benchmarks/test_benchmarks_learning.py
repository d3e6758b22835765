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

# 3-letter words over "abcd" reversed; small enough for a 1-epoch SFT and 1-2 RL steps
TASK = '''
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
'''


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "outside" / "reverse_task.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(TASK))
    return str(path)


@pytest.mark.parametrize("a, b", [([1, 2, 3], [4, 5, 7]), ([0.4, 0.45, 0.5], [0.42, 0.6, 0.61, 0.7]), ([1, 2], [1.5, 9])])
def test_welch_t_test_matches_the_incomplete_beta_reference(a, b):
    import mpmath
    import numpy as np

    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t_ref = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    p_ref = float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t_ref**2), regularized=True))  # P(|T| > |t|)
    t, p = report.welch_t_test(a, b)
    assert t == pytest.approx(t_ref, rel=1e-12) and p == pytest.approx(p_ref, abs=1e-5)


def test_welch_t_test_degenerate_samples():
    t, p = report.welch_t_test([1, 2, 3], [1, 2, 3])
    assert t == 0.0 and p == pytest.approx(1.0, abs=1e-6)
    assert all(math.isnan(v) for v in report.welch_t_test([1.0], [2.0, 3.0]))


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


@pytest.mark.e2e
def test_study_chain_on_a_task_module_outside_the_repo(task_file, tmp_path):
    out = tmp_path / "results"
    path = bench_learning.main(
        ["--task", task_file, "--out", str(out), "--parts", "pods", "--methods", "PODS", "--seeds", "0",
         "--steps", "2", "--eval-every", "1", "--eval-samples", "2", "--prompts", "8"]
    )  # fmt: skip
    document = json.loads(Path(path).read_text())
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
    assert set(summary["heldout_accuracy"]["rl"]) == {"greedy", "sampled", "entropy"}
