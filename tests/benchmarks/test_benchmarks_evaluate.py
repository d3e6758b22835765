"""RESULTS.md section 7 from bench_evaluate.py's JSON: the ratio, the verdict and the command as measured."""

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from reporting.sections import evaluate_section  # noqa: E402


def document(bare, evaluator):
    return {
        "date": "2026-11-25",
        "machine": "test CPU, 2 CPUs",
        "command": "bench --prompts 4",
        "prompts": 4,
        "n": 2,
        "max_new_tokens": 8,
        "repeats": 1,
        "median_seconds": {"bare": bare, "evaluator": evaluator},
        "tokens": {"bare": 40, "evaluator": 40},
        "tokens_per_second": {"bare": 40 / bare, "evaluator": 40 / evaluator},
        "ratio": evaluator / bare,
    }


def test_section_states_ratio_and_verdict():
    text = "\n".join(evaluate_section(document(2.0, 2.1), 7))
    assert text.startswith("## 7. Checkpoint evaluation") and "`bench --prompts 4`" in text
    assert "**1.050** (goal: at most 1.10, met)" in text and "(5 on average" in text
    assert "| evaluator | 2.10 | 40 | 19 |" in text
    assert "not met" in "\n".join(evaluate_section(document(2.0, 2.4), 7))


def test_the_recorded_measurement_is_the_one_in_results_md():
    measured = json.loads((BENCHMARKS / "results" / "evaluate.json").read_text())
    assert "\n".join(evaluate_section(measured, 7)) in (BENCHMARKS / "RESULTS.md").read_text()
