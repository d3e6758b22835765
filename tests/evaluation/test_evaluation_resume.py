"""A rerun into the same --out keeps only samples that answer the data's rows as they are now and that the model's
files as they are now generated, and a model is one model however its path is spelt. Generation is faked (no Ray,
no vLLM): a prompt's n samples are prefixes of its prompt tokens, scored with the test reward, written through the
evaluator's own sample lines."""

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest

from d3s_openrlhf.cli import evaluate as cli
from d3s_openrlhf.evaluation import generate, runner
from d3s_openrlhf.tasks import addition
from d3s_openrlhf.testbed import toy

N = 4  # eval_argv's --n


@pytest.fixture
def generated(monkeypatch):
    """The (model, index) of each prompt the evaluation generates, in order; Ray and the engines faked."""
    calls = []

    def generate_and_score(engines, requests, sampling, reward_func, tokenizer, model, digest, on_prompt):
        for request in requests:
            calls.append((model, request.row.index))
            outputs = [SimpleNamespace(token_ids=request.token_ids[: j + 1], finish_reason="stop") for j in range(N)]
            rewards = generate.score(request, outputs, reward_func, tokenizer)
            sampled = SimpleNamespace(outputs=outputs)
            on_prompt(generate.sample_lines(model, digest, request, sampled, None, rewards, tokenizer))

    monkeypatch.setattr(runner, "start_ray", lambda gpus: False)
    monkeypatch.setattr(runner, "start_engines", lambda *args: (None, None))
    monkeypatch.setattr(runner, "stop_engines", lambda engines, group: None)
    monkeypatch.setattr(runner, "generate_and_score", generate_and_score)
    return calls


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def refusal(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def swap(rows, i, j):
    rows[i], rows[j] = rows[j], rows[i]


def edit(key, value, at):
    def change(rows):
        rows[at] = {**rows[at], key: value}

    return change


def cut(at):
    def change(rows):
        del rows[at:]

    return change


OTHER_PROMPT = addition.make_examples("rl", 1, 0)[0]["prompt"]


@pytest.mark.parametrize(
    "change, first_differing",
    [
        pytest.param(lambda rows: swap(rows, 3, 4), 3, id="reordered"),
        pytest.param(lambda rows: rows.reverse(), 0, id="reversed"),
        pytest.param(edit("prompt", OTHER_PROMPT, 7), 7, id="other_prompt"),
        pytest.param(edit("label", "-1", 5), 5, id="other_label"),
        pytest.param(edit("datasource", "other", 2), 2, id="other_datasource"),
        pytest.param(lambda rows: rows.pop(9), 9, id="row_removed"),
        pytest.param(cut(10), 10, id="cut"),
    ],
)
def test_data_regenerated_in_place_is_refused_naming_the_first_differing_index(
    eval_inputs, eval_argv, generated, tmp_path, capsys, change, first_differing
):
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    rows = [dict(row) for row in eval_inputs["rows"]]
    write_rows(data, rows)
    argv = eval_argv(out) + ["--data", str(data)]
    cli.main(argv)
    assert len(generated) == len(rows)
    kept = (out / "samples.jsonl").read_text()

    change(rows)
    write_rows(data, rows)
    err = refusal(argv, capsys)
    assert re.search(rf"samples at index {first_differing}\b", err)
    assert f"give another --out, or delete {out / 'samples.jsonl'}" in err
    assert len(generated) == len(eval_inputs["rows"]) and (out / "samples.jsonl").read_text() == kept


def test_rows_appended_to_the_data_are_generated_and_the_others_kept(eval_inputs, eval_argv, generated, tmp_path):
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    rows = [dict(row) for row in eval_inputs["rows"]]
    write_rows(data, rows)
    argv = eval_argv(out) + ["--data", str(data)]
    cli.main(argv)
    more = [
        {"prompt": e["prompt"], "label": e["answer"], "datasource": "more"} for e in addition.make_examples("rl", 3, 0)
    ]
    write_rows(data, rows + more)
    cli.main(argv)
    assert [index for _, index in generated] == list(range(len(rows) + len(more)))
    document = json.loads((out / "results.json").read_text())
    assert {source: block["prompts"] for source, block in document["benchmarks"].items()} == {
        "even": 6,
        "odd": 6,
        "more": 3,
    }


@pytest.mark.parametrize("digest", ["row_digest", "model_digest"])
def test_samples_without_a_digest_are_refused(
    eval_inputs, eval_argv, generated, tmp_path, capsys, read_samples, digest
):
    out = tmp_path / "out"
    cli.main(eval_argv(out))
    # what the evaluator wrote before it checked the samples against the data, or against the model's files
    lines = [{key: value for key, value in line.items() if key != digest} for line in read_samples(out)]
    (out / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    err = refusal(eval_argv(out), capsys)
    assert f"samples without {digest}" in err and f"delete {out / 'samples.jsonl'} to generate them again" in err
    assert len(generated) == len(eval_inputs["rows"])


@pytest.mark.parametrize(
    "first, second",
    [("model", "model/"), ("./model", "{abs}"), ("{abs}/", "model"), ("model", "../{name}/model")],
)
def test_a_model_is_one_model_however_its_path_is_spelt(
    eval_inputs, eval_argv, generated, tmp_path, monkeypatch, read_samples, first, second
):
    model = eval_inputs["model"]
    monkeypatch.chdir(os.path.dirname(model))
    spell = {"abs": model, "name": os.path.basename(os.path.dirname(model))}
    out = tmp_path / "out"
    cli.main(eval_argv(out) + ["--model", first.format(**spell)])
    document = json.loads((out / "results.json").read_text())
    cli.main(eval_argv(out) + ["--model", second.format(**spell)])
    assert generated == [(model, index) for index in range(len(eval_inputs["rows"]))], "nothing generated again"
    assert len(read_samples(out)) == len(eval_inputs["rows"]) * N
    assert {line["model"] for line in read_samples(out)} == {model}
    assert json.loads((out / "results.json").read_text()) == document


@pytest.fixture
def checkpoint(eval_inputs, tmp_path):
    """A run's --ckpt.output_dir: a copy of the test model that a test may save over in place."""
    return shutil.copytree(eval_inputs["model"], tmp_path / "ckpt")


def test_a_checkpoint_saved_over_with_other_weights_is_generated_again(
    eval_inputs, eval_argv, generated, tmp_path, capsys, checkpoint, read_samples
):
    out, prompts = tmp_path / "out", len(eval_inputs["rows"])
    argv = eval_argv(out) + ["--model", str(checkpoint)]
    cli.main(argv)
    before = read_samples(out)
    toy.save_model_and_tokenizer(str(checkpoint), seed=1)  # the run continued into the same output dir
    capsys.readouterr()
    cli.main(argv)
    assert [index for _, index in generated] == list(range(prompts)) * 2
    assert str(prompts) in capsys.readouterr().err  # says how many prompts it generates again
    after = read_samples(out)
    assert len(after) == prompts * N, "the old samples are gone from the file, the new ones in"
    assert len({line["model_digest"] for line in before}) == len({line["model_digest"] for line in after}) == 1
    assert before[0]["model_digest"] != after[0]["model_digest"]


def test_the_same_weights_saved_again_in_place_keep_their_samples(
    eval_inputs, eval_argv, generated, tmp_path, checkpoint, read_samples
):
    out = tmp_path / "out"
    argv = eval_argv(out) + ["--model", str(checkpoint)]
    cli.main(argv)
    kept = (out / "samples.jsonl").read_text()
    toy.save_model_and_tokenizer(str(checkpoint), seed=0)  # the same model written again: new files, same bytes
    cli.main(argv)
    assert len(generated) == len(eval_inputs["rows"]) and (out / "samples.jsonl").read_text() == kept


def test_only_the_model_whose_weights_changed_is_generated_again(
    eval_inputs, eval_argv, generated, tmp_path, checkpoint, read_samples
):
    out, prompts = tmp_path / "out", len(eval_inputs["rows"])
    argv = eval_argv(out) + ["--model", eval_inputs["model"], str(checkpoint)]
    cli.main(argv)
    toy.save_model_and_tokenizer(str(checkpoint), seed=1)
    cli.main(argv)
    assert generated[2 * prompts :] == [(str(checkpoint), index) for index in range(prompts)]
    assert len(generated) == 3 * prompts and len(read_samples(out)) == 2 * prompts * N


def test_a_regeneration_cut_short_keeps_the_prompts_it_regenerated(
    eval_inputs, eval_argv, generated, tmp_path, monkeypatch, checkpoint, read_samples
):
    out, prompts = tmp_path / "out", len(eval_inputs["rows"])
    argv = eval_argv(out) + ["--model", str(checkpoint)]
    cli.main(argv)
    toy.save_model_and_tokenizer(str(checkpoint), seed=1)
    monkeypatch.setenv("EVAL_TEST_FAIL_AT", "5")  # the reward raises on the 5th prompt: 4 regenerated, then a stop
    with pytest.raises(SystemExit):
        cli.main(argv)
    monkeypatch.delenv("EVAL_TEST_FAIL_AT")
    cli.main(argv)
    assert [index for _, index in generated] == list(range(prompts)) + list(range(5)) + list(range(4, prompts))
    assert len(read_samples(out)) == prompts * N and len({line["model_digest"] for line in read_samples(out)}) == 1
