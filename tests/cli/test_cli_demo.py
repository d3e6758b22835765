"""The demo's learning chain on a task module written here (outside the repository): SFT, one real Ray RL run,
held-out evaluation, its summary. (tests/test_docs.py checks that this file runs the README's demo entrypoint.)"""

import json
import textwrap

import pytest

from d3s_openrlhf.cli import demo

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


@pytest.mark.e2e
def test_the_demo_on_a_task_module_outside_the_repo(tmp_path):
    task_file = tmp_path / "outside" / "reverse_task.py"
    task_file.parent.mkdir()
    task_file.write_text(textwrap.dedent(TASK))
    # 1 RL step (16 prompts), the summary names the task
    demo.main(["--out", str(tmp_path / "demo"), "--task", str(task_file), "--episodes", "1", "--grpo-only"])
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["task"] == str(task_file) and len(summary["steps"]) == 1
    assert set(summary["heldout_accuracy"]["rl"]) == {"greedy", "sampled", "pass@8", "entropy"}
