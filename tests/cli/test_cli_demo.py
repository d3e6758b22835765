"""The demo's learning chain on a task module written here (outside the repository): SFT, one real Ray RL run,
held-out evaluation, its summary. (tests/test_docs.py checks that this file runs the README's demo entrypoint.)"""

import json
import textwrap

import numpy as np
import pytest

from d3s_openrlhf.cli import demo

# 3-letter words over "abcd" reversed; small enough for a 1-epoch SFT and one RL step of 8 prompts
TASK = """
import itertools
import random

TASK_CONFIG = dict(n_sft=20, n_prompts=8, n_heldout=8, sft_epochs=1, sft_batch_size=4)


def make_examples(split, n, seed):
    words = ["".join(w) for w in itertools.product("abcd", repeat=3)]
    random.Random(seed).shuffle(words)
    chosen = words[{"sft": 0, "rl": 1, "heldout": 2}[split] :: 3][:n]
    return [{"prompt": w + ">", "answer": w[::-1], "sft_response": w[::-1]} for w in chosen]


def reward(response, answer):
    return float(response == answer)
"""


@pytest.mark.e2e
def test_the_demo_on_a_task_module_outside_the_repo(tmp_path):
    task_file = tmp_path / "outside" / "reverse_task.py"
    task_file.parent.mkdir()
    task_file.write_text(textwrap.dedent(TASK))
    # 1 RL step (8 prompts), the summary names the task; GRPO at its own rate
    demo.main(["--out", str(tmp_path / "demo"), "--task", str(task_file), "--grpo-only"])
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["task"] == str(task_file) and len(summary["steps"]) == 1 and summary["lr"] == 2.5e-5
    heldout = summary["heldout"]
    assert heldout["prompts"] == 8 and set(heldout["rl"]) == {"greedy", "sampled", "pass@8", "entropy"}
    for model in ("sft", "rl", "change"):
        assert all(heldout[model][key]["ci95"] >= 0 for key in ("greedy", "sampled", "pass@8"))


def test_the_held_out_change_has_the_paired_interval_of_the_per_prompt_differences(tmp_path):
    sft = {"greedy": np.array([0.0, 0.0, 1.0, 0.0]), "sampled": np.array([0.25, 0.5, 0.75, 0.0]), "entropy": 0.3}
    rl = {"greedy": np.array([1.0, 1.0, 1.0, 0.0]), "sampled": np.array([0.5, 0.5, 1.0, 0.25]), "entropy": 0.2}
    heldout = demo.heldout_summary(sft, rl)
    assert heldout["prompts"] == 4 and heldout["sft"]["entropy"] == 0.3
    difference = [1.0, 1.0, 0.0, 0.0]  # greedy, rl - sft per prompt: mean 0.5, sample std 0.57735
    assert heldout["change"]["greedy"]["mean"] == pytest.approx(0.5)
    assert heldout["change"]["greedy"]["ci95"] == pytest.approx(1.959964 * np.std(difference, ddof=1) / 2)
    assert heldout["change"]["greedy"]["standard_errors"] == pytest.approx(0.5 / (np.std(difference, ddof=1) / 2))
    assert heldout["rl"]["sampled"]["mean"] == pytest.approx(0.5625)
    # no spread in the differences: no size in standard errors
    assert demo.heldout_summary(sft, sft)["change"]["sampled"] == {"mean": 0.0, "ci95": 0.0, "standard_errors": None}
    steps = [dict(step=s, reward=0.5, kept_rollout_frac=0.5, kept_token_frac=None) for s in (1, 2, 3)]
    demo.plot(steps, heldout, str(tmp_path / "progress.png"), "GRPO", "a task")
    assert (tmp_path / "progress.png").stat().st_size > 0
