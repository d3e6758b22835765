"""d3s_openrlhf.data.prepare on tiny hand-written samples of each source format (tests/data/fixtures/)."""

import json
from pathlib import Path

import pytest

from d3s_openrlhf.data import prepare
from d3s_openrlhf.rewards.math_reward import score_response

FIXTURES = Path(__file__).resolve().parent / "fixtures"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def run(tmp_path, *args):
    out = tmp_path / "out" / "data.jsonl"
    assert prepare.main([*args, "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def questions(records):
    assert all(r["prompt"].endswith("\n" + INSTRUCTION) for r in records)
    return [r["prompt"][: -len(INSTRUCTION) - 1] for r in records]


def labels(records):
    return [r["label"] for r in records]


# -- one test per source format ------------------------------------------------------------------------------


def test_dapo_math_17k_strips_its_instructions_and_duplicates(tmp_path, capsys):
    records = run(tmp_path, "--dataset", "dapo-math-17k", "--input", str(FIXTURES / "dapo_math_17k.jsonl"))
    assert questions(records) == [
        "What is the remainder when $2^{10}$ is divided by $7$?",
        "How many positive divisors does $36$ have?",
        "Find the sum of all integers $n$ with $1 \\le n \\le 20$.",
    ]
    assert labels(records) == ["2", "9", "210"]
    assert {r["datasource"] for r in records} == {"dapo-math-17k"}
    assert "1 duplicates dropped" in capsys.readouterr().err


def test_dapo_from_parquet_and_keep_duplicates(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIXTURES / "dapo_math_17k.jsonl").read_text().splitlines()]
    source = tmp_path / "dapo" / "train-00000-of-00001.parquet"
    source.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), source)
    from_parquet = run(tmp_path, "--dataset", "dapo-math-17k", "--input", str(source.parent), "--keep-duplicates")
    assert labels(from_parquet) == ["2", "9", "2", "210"]


def test_math_lighteval_takes_the_last_box_of_the_solution(tmp_path, capsys):
    records = run(tmp_path, "--dataset", "math-lighteval", "--input", str(FIXTURES / "math_lighteval.jsonl"))
    assert questions(records) == ["Simplify $\\frac{3}{6}$.", "Solve $x+2=5$ for $x$."]
    assert labels(records) == ["\\frac{1}{2}", "3"]  # nested braces; the last of two boxes
    assert "1 skipped" in capsys.readouterr().err  # the solution without a box


def test_deepscaler_json_array(tmp_path):
    records = run(tmp_path, "--dataset", "deepscaler", "--input", str(FIXTURES / "deepscaler.json"))
    assert labels(records) == ["6", "\\frac{1}{4}"]  # "$\frac{1}{4}$" unwrapped
    assert questions(records)[1] == "What is $\\left(\\frac{1}{2}\\right)^2$?"


@pytest.mark.parametrize(
    "split, expected",
    [("test", ["1000", "60"]), ("train", ["7"])],
)
def test_gsm8k_directory_split_and_answer_after_hashes(tmp_path, split, expected):
    records = run(tmp_path, "--dataset", "gsm8k", "--input", str(FIXTURES / "gsm8k"), "--split", split)
    assert labels(records) == expected  # "#### 1,000" -> "1000"
    assert all(r["datasource"] == "gsm8k" for r in records)


def test_aime24(tmp_path):
    records = run(tmp_path, "--dataset", "aime24", "--input", str(FIXTURES / "aime24.jsonl"))
    assert labels(records) == ["009", "35"]
    assert questions(records)[1] == "Find $2^{5}+3$."


def test_aime25(tmp_path):
    records = run(tmp_path, "--dataset", "aime25", "--input", str(FIXTURES / "aime25.jsonl"))
    assert [(r["label"], r["datasource"]) for r in records] == [("15", "aime25")]


def test_amc23_numeric_answers(tmp_path):
    records = run(tmp_path, "--dataset", "amc23", "--input", str(FIXTURES / "amc23.jsonl"))
    assert labels(records) == ["27", "2.5"]  # JSON 27.0 -> "27"
    assert questions(records)[0] == "What is $3 \\cdot 9$?"


def test_math500_prefers_the_answer_field(tmp_path):
    records = run(tmp_path, "--dataset", "math500", "--input", str(FIXTURES / "math500.jsonl"))
    assert labels(records) == ["\\frac{1}{3}", "-2, 2"]


def test_minerva_boxed_solution(tmp_path):
    records = run(tmp_path, "--dataset", "minerva", "--input", str(FIXTURES / "minerva.jsonl"))
    assert labels(records) == ["20", "3"]


def test_olympiadbench_final_answer_lists(tmp_path, capsys):
    records = run(tmp_path, "--dataset", "olympiadbench", "--input", str(FIXTURES / "olympiadbench.jsonl"))
    assert labels(records) == ["\\frac{1}{2}", "3, 5"]
    assert "1 skipped" in capsys.readouterr().err  # empty final_answer


# -- options -----------------------------------------------------------------------------------------------------


def test_limit_and_datasource(tmp_path):
    records = run(
        tmp_path, "--dataset", "aime24", "--input", str(FIXTURES / "aime24.jsonl"), "--limit", "1", "--datasource", "x"
    )
    assert [(r["label"], r["datasource"]) for r in records] == [("009", "x")]


def test_key_overrides(tmp_path):
    source = tmp_path / "custom.jsonl"
    source.write_text(json.dumps({"q": "What is $6 \\times 7$?", "meta": {"gold": "$42$"}}) + "\n")
    records = run(
        tmp_path, "--dataset", "aime24", "--input", str(source), "--question-key", "Q", "--label-key", "meta.gold"
    )
    assert questions(records) == ["What is $6 \\times 7$?"] and labels(records) == ["42"]


def test_column_oriented_json(tmp_path):
    source = tmp_path / "columns.json"
    source.write_text(json.dumps({"problem": ["1+1?", "2+2?"], "answer": [2, 4]}))
    assert labels(run(tmp_path, "--dataset", "aime24", "--input", str(source))) == ["2", "4"]


def test_no_usable_rows_fails_without_leaving_a_file(tmp_path):
    with pytest.raises(SystemExit, match="no usable rows"):
        run(tmp_path, "--dataset", "gsm8k", "--input", str(FIXTURES / "aime24.jsonl"))
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "argv",
    [
        ["--dataset", "nope"],
        ["--dataset", "eval-suite", "--input", str(FIXTURES / "aime24.jsonl")],
        ["--dataset", "aime24", "--input", str(FIXTURES / "missing.jsonl")],
        ["--dataset", "aime24", "--input", str(FIXTURES / "aime24.jsonl"), "--limit", "0"],
    ],
)
def test_bad_arguments(tmp_path, argv):
    with pytest.raises((SystemExit, FileNotFoundError)):
        run(tmp_path, *argv)


def test_eval_suite_is_the_papers_seven_benchmarks():
    plan = prepare._plan("eval-suite", None)
    assert [(spec.name, split) for spec, split in plan] == [
        ("aime24", "train"),
        ("aime25", "test"),
        ("amc23", "test"),
        ("gsm8k", "test"),
        ("math500", "test"),
        ("minerva", "test"),
        ("olympiadbench", "train"),
    ]
    assert prepare._plan("math-lighteval,gsm8k", None)[1][1] == "train"


def test_list(capsys):
    assert prepare.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in [*prepare.DATASETS, "eval-suite"])


# -- the output works downstream -----------------------------------------------------------------------------------

ALL_FIXTURES = [
    ("dapo-math-17k", "dapo_math_17k.jsonl", None),
    ("math-lighteval", "math_lighteval.jsonl", None),
    ("deepscaler", "deepscaler.json", None),
    ("gsm8k", "gsm8k", "test"),
    ("aime24", "aime24.jsonl", None),
    ("aime25", "aime25.jsonl", None),
    ("amc23", "amc23.jsonl", None),
    ("math500", "math500.jsonl", None),
    ("minerva", "minerva.jsonl", None),
    ("olympiadbench", "olympiadbench.jsonl", None),
]


def _all_records(tmp_path):
    records = []
    for name, fixture, split in ALL_FIXTURES:
        args = ["--dataset", name, "--input", str(FIXTURES / fixture)] + (["--split", split] if split else [])
        records += run(tmp_path / name, *args)
    return records


def test_every_label_is_a_gold_answer_the_reward_accepts(tmp_path):
    """A boxed copy of the label must score 1, and a wrong number 0: labels are parseable by math-verify."""
    for record in _all_records(tmp_path):
        assert score_response(f"so \\boxed{{{record['label']}}}", record["label"]) == (1.0, 1.0), record
        assert score_response("so \\boxed{123456789}", record["label"]) == (0.0, 1.0), record


def test_output_loads_like_openrlhf_loads_prompt_data(tmp_path):
    """blending_datasets reads local .jsonl with load_dataset("json"); preprocess_data reads input/label keys."""
    from datasets import load_dataset
    from openrlhf.datasets.prompts_dataset import preprocess_data

    merged = tmp_path / "eval.jsonl"
    records = _all_records(tmp_path)
    merged.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = load_dataset("json", data_files=str(merged))["train"]
    assert data.column_names == ["prompt", "label", "datasource"] and len(data) == len(records)
    prompt, label = preprocess_data(data[0], input_key="prompt", label_key="label")
    assert (prompt, label) == (records[0]["prompt"], records[0]["label"])
