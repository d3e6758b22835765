"""The math-verify reward of d3s_openrlhf/rewards/math_reward.py, called as OpenRLHF 0.11.2 calls it."""

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from d3s_openrlhf.rewards import math_reward
from d3s_openrlhf.rewards.math_reward import last_boxed_content, response_of, reward_func, score_response

REWARD_FILE = Path(math_reward.__file__).resolve()
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT = "<|im_start|>user\nWhat is 1/2 as a decimal?\n" + INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n"
SLOW = "9^{9^{9^{9}}}"  # sympy cannot decide 9^(9^(9^9)) = 1 quickly: math-verify's timeout must fire


@pytest.fixture(autouse=True)
def _clean_settings(monkeypatch):
    for name in (math_reward.FORMAT_WEIGHT_ENV, math_reward.TIMEOUT_ENV, math_reward.WORKERS_ENV):
        monkeypatch.delenv(name, raising=False)


def query(response: str, prompt: str = PROMPT) -> str:
    return prompt + response + "<|im_end|>"


def rewards_of(responses, labels, prompt=PROMPT):
    out = reward_func([query(r, prompt) for r in responses], [prompt] * len(responses), labels)
    return out["rewards"].tolist()


# -- extraction ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\left\\{ \\frac{a}{b^{2}} \\right\\}}", "\\left\\{ \\frac{a}{b^{2}} \\right\\}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("first \\boxed{2}, then corrected: \\boxed{3}", "3"),
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$.", "5"),
        ("\\boxed   { x^{2} }", "x^{2}"),
        ("\\boxed{1} and the final \\boxed{\\dfrac{3}{4}} done", "\\dfrac{3}{4}"),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "no box at all: 42",
        "\\boxed{}",
        "\\boxed{   }",
        "truncated \\boxed{\\frac{1}{2",
        "an earlier \\boxed{3} then a truncated \\boxed{\\frac{1",
        "\\boxedfoo{3}",
        "\\boxed",
        "",
        None,
        12,
    ],
)
def test_last_boxed_content_none(text):
    assert last_boxed_content(text) is None


def test_response_of_strips_the_prompt_and_its_empty_box():
    assert response_of(query("\\boxed{0.5}"), PROMPT) == "\\boxed{0.5}<|im_end|>"
    # the instruction's \boxed{} is in the prompt: without an answer the last box is the (empty) instruction's
    assert last_boxed_content(response_of(query("I give up."), PROMPT)) is None
    assert last_boxed_content(query("I give up.")) is None
    # a prompt that is not in the query (e.g. left-truncated): the whole query is searched
    assert response_of("tail of the prompt \\boxed{1}", PROMPT) == "tail of the prompt \\boxed{1}"


# -- correctness ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, label",
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\dfrac12", "0.5"),
        ("\\frac{1}{2}", "1/2"),
        ("x = 3", "3"),
        ("1,000", "1000"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("[2, 5)", "[2,5)"),
        ("\\{3, 5\\}", "3, 5"),
        ("5, 3", "3, 5"),
        ("9", "009"),
        ("\\text{(B)}", "B"),
        ("\\frac{\\pi}{2}", "\\pi/2"),
        ("20 \\text{ meters}", "20"),
        ("-\\frac{1}{2}", "$-0.5$"),
        ("7", "\\boxed{7}"),
    ],
)
def test_equivalent_forms_score_one(answer, label):
    assert rewards_of([f"Thus \\boxed{{{answer}}}."], [label]) == [1.0]


@pytest.mark.parametrize(
    "answer, label",
    [
        ("3", "4"),
        ("\\frac{1}{3}", "0.333"),
        ("[2, 5]", "[2,5)"),
        ("-2", "2"),
        ("\\text{(C)}", "B"),
        ("x^2 + 1", "x^2 - 1"),
        ("2, 3", "3, 5"),
    ],
)
def test_wrong_answers_score_zero(answer, label):
    assert rewards_of([f"Thus \\boxed{{{answer}}}."], [label]) == [0.0]


def test_only_the_last_box_counts():
    assert rewards_of(["\\boxed{0.5} no wait, \\boxed{0.25}"], ["0.5"]) == [0.0]
    assert rewards_of(["\\boxed{0.25} no wait, \\boxed{0.5}"], ["0.5"]) == [1.0]


def test_an_unboxed_correct_answer_scores_zero():
    out = reward_func([query("The answer is 0.5")], [PROMPT], ["0.5"])
    assert out["rewards"].tolist() == [0.0]
    assert out["extra_logs"]["math_format"].tolist() == [0.0]


@pytest.mark.parametrize(
    "response",
    [
        "",
        "\\boxed{",
        "\\boxed{\\frac{1}{",
        "\\boxed{}}}}{{{",
        "\\boxed{\\frac{}{}}",
        "\\boxed{\\begin{pmatrix} 1 & 2 \\end{pmatrix}",
        "\\boxed{%$#@!^&*()_+}",
        "\\boxed{\\\\\\\\\\\\}",
        "\\boxed{" + "(" * 500 + "}",
        "\\boxed{" + "1+" * 300 + "1}",
        "\x00\x01\ufffd\U0001f600 \\boxed{\x00}",
        "\\boxed{\\undefinedmacro{x}{y}}",
        "word " * 20000 + "\\boxed{oops",
    ],
)
def test_garbage_never_raises_and_scores_zero(response):
    out = reward_func([query(response)], [PROMPT], ["0.5"])
    assert out["rewards"].tolist() == [0.0]
    assert out["scores"].tolist() == [0.0]


def test_malformed_rows_score_zero():
    out = reward_func(
        [None, query("\\boxed{1}"), query("\\boxed{1}"), 17], [PROMPT, PROMPT, 3.5, None], ["1", None, "1", "1"]
    )
    assert out["rewards"].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_non_string_labels_and_missing_prompts():
    out = reward_func([query("\\boxed{7}"), query("\\boxed{2.5}")], None, [7, 2.5])
    assert out["rewards"].tolist() == [1.0, 1.0]


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 queries, 1 prompts and 2 labels"):
        reward_func([query("a"), query("b")], [PROMPT], ["1", "2"])


# -- the return value OpenRLHF consumes ------------------------------------------------------------------------


def test_return_value_types_and_shapes():
    out = reward_func([query("\\boxed{0.5}"), query("\\boxed{2}"), query("none")], [PROMPT] * 3, ["1/2", "3", "1"])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    for tensor in (out["rewards"], out["scores"], *out["extra_logs"].values()):
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.shape == (3,)
    assert set(out["extra_logs"]) == {"math_accuracy", "math_format"}
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert out["scores"].tolist() == [1.0, 0.0, 0.0]
    assert out["extra_logs"]["math_format"].tolist() == [1.0, 1.0, 0.0]


def test_format_weight(monkeypatch):
    monkeypatch.setenv(math_reward.FORMAT_WEIGHT_ENV, "0.2")
    out = reward_func([query("\\boxed{0.5}"), query("\\boxed{2}"), query("0.5")], [PROMPT] * 3, ["0.5"] * 3)
    assert out["rewards"].tolist() == pytest.approx([1.0, 0.2, 0.0])
    assert out["scores"].tolist() == [1.0, 0.0, 0.0]  # scores stay 0/1 accuracy (dynamic filtering)


@pytest.mark.parametrize(
    "name, value",
    [
        (math_reward.FORMAT_WEIGHT_ENV, "1.5"),
        (math_reward.FORMAT_WEIGHT_ENV, "much"),
        (math_reward.TIMEOUT_ENV, "0"),
        (math_reward.TIMEOUT_ENV, "2.5"),
        (math_reward.WORKERS_ENV, "-1"),
    ],
)
def test_invalid_settings_raise(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        reward_func([query("\\boxed{1}")], [PROMPT], ["1"])


# -- threads, timeouts and OpenRLHF's own loader -----------------------------------------------------------------

BATCH = [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.3}", "0.5", 0.0),
    ("no box", "0.5", 0.0),
    ("\\boxed{x=3}", "3", 1.0),
    ("\\boxed{\\frac{1}{", "0.5", 0.0),
]


def test_worker_thread_matches_main_thread():
    """OpenRLHF calls reward_func through asyncio.to_thread: signal-based timeouts are unusable there."""
    queries = [query(response) for response, _, _ in BATCH]
    labels = [label for _, label, _ in BATCH]
    in_main = reward_func(queries, [PROMPT] * len(BATCH), labels)
    in_thread = asyncio.run(asyncio.to_thread(reward_func, queries, [PROMPT] * len(BATCH), labels))
    assert in_main["rewards"].tolist() == in_thread["rewards"].tolist() == [want for _, _, want in BATCH]


def test_many_concurrent_threads(monkeypatch):
    monkeypatch.setenv(math_reward.WORKERS_ENV, "2")

    async def all_rows():
        calls = [
            asyncio.to_thread(reward_func, [query(response)], [PROMPT], [label]) for response, label, _ in BATCH * 3
        ]
        return await asyncio.gather(*calls)

    results = asyncio.run(all_rows())
    assert [r["rewards"].item() for r in results] == [want for _, _, want in BATCH * 3]


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_slow_comparisons_time_out_to_zero(monkeypatch, where):
    monkeypatch.setenv(math_reward.TIMEOUT_ENV, "1")
    args = ([query(f"\\boxed{{{SLOW}}}")], [PROMPT], ["1"])
    if where == "main thread":
        out = reward_func(*args)
    else:
        out = asyncio.run(asyncio.to_thread(reward_func, *args))
    assert out["rewards"].tolist() == [0.0]
    assert out["extra_logs"]["math_format"].tolist() == [1.0]


def test_grader_overrunning_the_deadline_is_replaced():
    pool = math_reward._GraderPool(size=1, timeout=30, deadline_seconds=2)
    try:
        assert pool.judge("\\frac12", "0.5") is True
        assert pool.judge(SLOW, "1") is None  # None: killed at the hard deadline, before math-verify's 30 s
        assert pool.judge("\\frac12", "0.5") is True  # a fresh child took its place
    finally:
        pool.close()


def test_grader_rejects_non_main_thread_use_of_math_verify_directly():
    """Why the grader children exist: math-verify's own timeouts fail off the main thread."""
    errors = []

    def call():
        try:
            math_reward.judge("\\frac{1}{2}", "0.5", 1)
        except ValueError as error:
            errors.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "thread" in str(errors[0])


def test_loaded_and_called_by_openrlhf_single_turn_executor():
    """Upstream's loader (spec_from_file_location) and call path (asyncio.to_thread), then its conversions."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    executor = SingleTurnAgentExecutor(remote_rm_url=[str(REWARD_FILE)])
    assert executor.reward_func.__module__ == "reward_func"  # the file-loaded copy, not the package module

    async def fetch():
        return await executor._fetch_rewards_via_func(
            [query("\\boxed{\\frac{1}{2}}"), query("\\boxed{1}")], [PROMPT, PROMPT], ["0.5", "0.5"]
        )

    infos = asyncio.run(fetch())
    assert len(infos) == 2  # upstream sends one query per call
    for info, want in zip(infos, [1.0, 0.0]):
        # what SingleTurnAgentExecutor.execute and SamplesGenerator._process_response_into_experience do with it
        reward, score = info.get("rewards"), info.get("scores")
        assert torch.tensor([reward]).shape == (1,) and torch.tensor([reward]).item() == want
        assert torch.tensor([score]).item() == want
        for value in info["extra_logs"].values():
            assert isinstance(value.flatten()[0].item(), float)


def test_file_loads_alone_without_importing_the_package(tmp_path):
    """--reward.remote_url loads the file by path: it must not need (or import) d3s_openrlhf."""
    script = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("reward_func", {str(REWARD_FILE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert not any(name.split(".")[0] == "d3s_openrlhf" for name in sys.modules), "imported d3s_openrlhf"
print(module.reward_func(["q \\\\boxed{{1/2}}"], ["q"], ["0.5"])["rewards"].tolist())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[1.0]"
    assert score_response("\\boxed{2}", "2") == (1.0, 1.0)
