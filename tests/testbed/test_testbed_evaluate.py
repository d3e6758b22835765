"""The CPU studies' held-out evaluation reports pass@1 (``sampled``) and pass@<samples> through core.pass_at_k."""

import itertools
import math
import statistics

import numpy as np
import pytest

from d3s_openrlhf.tasks import addition
from d3s_openrlhf.testbed import evaluate, toy


def brute_force(outcomes, k):
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_heldout_accuracy_reports_unbiased_pass_at_k(tmp_path, monkeypatch):
    model = toy.save_model_and_tokenizer(str(tmp_path / "model"))
    rows = [{"input": e["prompt"], "label": e["answer"]} for e in addition.make_examples("heldout", 3, 0)]
    heldout = toy.write_jsonl(str(tmp_path / "heldout.jsonl"), rows)
    calls = []

    def score(task, response, label):  # the i-th scored response is correct iff i % 5 == 0 (0.5: partial, wrong)
        calls.append(label)
        return [1.0, 0.0, 0.5, 0.0, 0.0][(len(calls) - 1) % 5]

    monkeypatch.setattr(evaluate.tasks, "score", score)
    result = evaluate.heldout_accuracy(model, heldout, samples=4)
    assert set(result) == {"greedy", "sampled", "pass@4", "entropy"}
    # calls: 3 greedy, then 4 x 3 sampled, sample r of prompt p at position r * 3 + p
    outcomes = [(i % 5 == 0) for i in range(len(calls))]
    assert result["greedy"] == pytest.approx(sum(outcomes[:3]) / 3)
    sampled = outcomes[3:]
    per_prompt = [[sampled[r * 3 + p] for r in range(4)] for p in range(3)]
    assert result["sampled"] == pytest.approx(sum(brute_force(o, 1) for o in per_prompt) / 3)
    assert result["pass@4"] == pytest.approx(sum(brute_force(o, 4) for o in per_prompt) / 3)


def test_heldout_scores_are_per_prompt_in_the_files_order(tmp_path, monkeypatch):
    model = toy.save_model_and_tokenizer(str(tmp_path / "model"))
    rows = [{"input": e["prompt"], "label": e["answer"]} for e in addition.make_examples("heldout", 3, 0)]
    heldout = toy.write_jsonl(str(tmp_path / "heldout.jsonl"), rows)
    # prompt 1 is always right, the others never
    monkeypatch.setattr(evaluate.tasks, "score", lambda task, response, label: float(label == rows[1]["label"]))
    scores = evaluate.heldout_scores(model, heldout, samples=2)
    for key in ("greedy", "sampled", "pass@2"):
        assert scores[key].tolist() == [0.0, 1.0, 0.0]
    assert evaluate.heldout_accuracy(model, heldout, samples=2)["greedy"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("values", [[1.0, 0.0, 1.0, 1.0], [0.25, 0.5, 0.125], [0.0] * 5, [0.7]])
def test_the_interval_is_the_mean_and_1_96_standard_errors(values):
    mean, half = evaluate.interval(np.array(values))
    assert mean == pytest.approx(statistics.fmean(values))
    expected = 1.959964 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    assert half == pytest.approx(expected)


def test_no_samples_is_greedy_alone(tmp_path, monkeypatch):
    # the speed study reads only the greedy curve: no sampled responses generated (or scored) for it
    model = toy.save_model_and_tokenizer(str(tmp_path / "model"))
    rows = [{"input": e["prompt"], "label": e["answer"]} for e in addition.make_examples("heldout", 3, 0)]
    heldout = toy.write_jsonl(str(tmp_path / "heldout.jsonl"), rows)
    calls = []
    monkeypatch.setattr(evaluate.tasks, "score", lambda task, response, label: calls.append(label) or 1.0)
    assert evaluate.heldout_accuracy(model, heldout, samples=0) == {"greedy": 1.0}
    assert len(calls) == 3
