"""Inputs of the evaluator's tests: a fresh toy model (no training: the tests check bookkeeping, not accuracy),
a two-benchmark data file of addition prompts, and a test reward file."""

import json
import os

import pytest

from d3s_openrlhf.tasks import addition
from d3s_openrlhf.testbed import toy

# correct iff the response (up to the EOS token) has an even number of characters: a mix of 0 and 1 from an
# untrained model. EVAL_TEST_FAIL_AT=m raises at the m-th call; EVAL_TEST_NAN_LABEL=l returns NaN for label l.
REWARD = """
import os

calls = 0


def reward_func(queries, prompts, labels):
    global calls
    calls += 1
    if calls == int(os.environ.get("EVAL_TEST_FAIL_AT", "0")):
        raise RuntimeError("grader crashed")
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[query.index(prompt) + len(prompt):].split("</s>")[0]
        nan = label == os.environ.get("EVAL_TEST_NAN_LABEL")
        rewards.append(float("nan") if nan else float(len(response) % 2 == 0))
    return {"rewards": rewards}
"""


@pytest.fixture(scope="session")
def eval_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_inputs")
    model = toy.save_model_and_tokenizer(str(root / "model"))
    rows = [
        {"prompt": e["prompt"], "label": e["answer"], "datasource": "odd" if i % 2 else "even"}
        for i, e in enumerate(addition.make_examples("heldout", 12, 0))
    ]
    data = toy.write_jsonl(str(root / "data.jsonl"), rows)
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {"model": model, "data": data, "reward": str(reward), "rows": rows, "root": str(root)}


@pytest.fixture
def eval_argv(eval_inputs):
    """``eval_argv(out, *extra)``: the evaluator's command line on the test inputs (4 samples, k = 1 2 4)."""

    def argv(out, *extra):
        return [
            *("--model", eval_inputs["model"]),
            *("--data", eval_inputs["data"]),
            *("--reward", eval_inputs["reward"]),
            *("--out", str(out)),
            *("--n", "4"),
            *("--k", "1", "2", "4"),
            *("--max_new_tokens", "4"),
            *("--temperature", "1.0"),
            *extra,
        ]

    return argv


@pytest.fixture
def read_samples():
    """``read_samples(out)``: the lines of ``out``/samples.jsonl."""

    def read(out):
        with open(os.path.join(out, "samples.jsonl")) as f:
            return [json.loads(line) for line in f]

    return read
