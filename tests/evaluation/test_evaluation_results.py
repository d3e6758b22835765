"""The evaluator's bookkeeping without a model: results from sample lines (against brute force), the table, the
resumable samples file, and scoring (a reward that raises or is not finite stops, naming the prompt)."""

import itertools
import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf.evaluation import generate, inputs, results, samples
from d3s_openrlhf.evaluation.inputs import Row


def line(model, index, source, sample, reward, greedy=False, finish="stop", tokens=3):
    return {
        "model": model,
        "index": index,
        "datasource": source,
        "prompt": f"p{index}",
        "label": "l",
        "sample": sample,
        "greedy": greedy,
        "response": "r",
        "response_tokens": tokens,
        "reward": reward,
        "finish_reason": finish,
    }


def brute_force(rewards, k):
    subsets = list(itertools.combinations([r >= 1 for r in rewards], k))
    return sum(any(s) for s in subsets) / len(subsets)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["aime", "gsm8k"]), st.lists(st.sampled_from([0.0, 1.0, 0.3]), min_size=4, max_size=4)
        ),
        min_size=1,
        max_size=6,
    )
)
def test_model_block_against_brute_force(prompts):
    lines = [line("m", i, source, s, r) for i, (source, rewards) in enumerate(prompts) for s, r in enumerate(rewards)]
    block = results.model_block(lines, [1, 2, 4], ["gsm8k", "aime", "unused"])
    sources = [s for s in ("gsm8k", "aime") if any(p[0] == s for p in prompts)]
    assert list(block["benchmarks"]) == sources
    for source in sources:
        groups = [rewards for s, rewards in prompts if s == source]
        got = block["benchmarks"][source]
        assert got["prompts"] == len(groups) and got["n"] == 4
        for k in (1, 2, 4):
            assert got[f"pass@{k}"] == pytest.approx(sum(brute_force(g, k) for g in groups) / len(groups), abs=1e-12)
        assert got["mean_reward"] == pytest.approx(sum(map(sum, groups)) / (4 * len(groups)))
    for k in (1, 2, 4):
        expected = sum(block["benchmarks"][s][f"pass@{k}"] for s in sources) / len(sources)
        assert block["average"][f"pass@{k}"] == pytest.approx(expected)


def test_greedy_truncation_and_lengths_are_reported_apart():
    lines = [
        line("m", 0, "a", s, 1.0 if s == 0 else 0.0, finish="length" if s == 1 else "stop", tokens=s + 1)
        for s in range(2)
    ]
    lines.append(line("m", 0, "a", 2, 1.0, greedy=True, finish="length", tokens=9))
    block = results.model_block(lines, [1], ["a"])["benchmarks"]["a"]
    assert block == {
        "prompts": 1,
        "n": 2,
        "pass@1": 0.5,
        "mean_reward": 0.5,
        "truncated": 0.5,
        "mean_response_tokens": 1.5,
        "greedy": 1.0,
    }


def test_table_and_documents(tmp_path):
    blocks = {
        "runs/grpo": results.model_block([line("g", 0, "aime", s, float(s == 0)) for s in range(4)], [1, 4], ["aime"]),
        "runs/d3s": results.model_block([line("d", 0, "aime", s, float(s < 2)) for s in range(4)], [1, 4], ["aime"]),
    }
    document = results.write_results(str(tmp_path), blocks, [1, 4])
    assert set(document) == {"runs/grpo", "runs/d3s"}
    assert json.loads((tmp_path / "results.json").read_text()) == document
    table = (tmp_path / "results.md").read_text().splitlines()
    assert table[2] == "| model | aime | average |"
    assert table[4] == "| runs/grpo | 25.0 / 100.0 | 25.0 / 100.0 |"
    assert table[5] == "| runs/d3s | 50.0 / 100.0 | 50.0 / 100.0 |"
    single = results.write_results(str(tmp_path), {"runs/d3s": blocks["runs/d3s"]}, [1, 4])
    assert set(single) == {"benchmarks", "average"}


def test_read_complete_drops_a_cut_write_and_rewrites_the_file(tmp_path):
    path = tmp_path / "samples.jsonl"
    whole = [line("m", 0, "a", s, 1.0) for s in range(3)] + [line("m", 1, "a", s, 0.0) for s in range(3)]
    text = "".join(json.dumps(x) + "\n" for x in whole)
    cut = text + json.dumps(line("m", 2, "a", 0, 1.0)) + "\n" + json.dumps(line("m", 2, "a", 1, 1.0))[:20]
    path.write_text(cut)
    complete = samples.read_complete(str(path), 3)
    assert sorted(complete) == [("m", 0), ("m", 1)]
    assert path.read_text() == text
    assert samples.read_complete(str(tmp_path / "none.jsonl"), 3) == {}


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(str, ids))


def _request():
    row = Row(index=5, file="data.jsonl", line=6, datasource="a", data={}, label="3", digest="d")
    return generate.Request(row, "1+2=", [1, 2])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_score_stops_on_a_non_finite_reward_naming_the_prompt(bad):
    outputs = [SimpleNamespace(token_ids=[3]), SimpleNamespace(token_ids=[4])]
    match = r"returned (nan|inf) for sample 1 of the prompt at data.jsonl:6"
    with pytest.raises(generate.EvaluationError, match=match):
        generate.score(_request(), outputs, lambda queries, prompts, labels: {"rewards": [1.0, bad]}, _Tokenizer())


def test_score_stops_when_the_reward_raises_naming_the_prompt():
    def reward_func(queries, prompts, labels):
        raise RuntimeError("grader crashed")

    with pytest.raises(generate.EvaluationError, match=r"raised on the prompt at data.jsonl:6 \(index 5\): Runtime"):
        generate.score(_request(), [SimpleNamespace(token_ids=[3])], reward_func, _Tokenizer())


def test_score_calls_the_reward_as_training_does():
    seen = []

    def reward_func(queries, prompts, labels):
        seen.append((queries, prompts, labels))
        return {"rewards": [1.0, 0.0]}

    outputs = [SimpleNamespace(token_ids=[3]), SimpleNamespace(token_ids=[4])]
    assert generate.score(_request(), outputs, reward_func, _Tokenizer()) == [1.0, 0.0]
    assert seen == [(["123", "124"], ["1+2=", "1+2="], ["3", "3"])]


def test_sampling_params_seed_every_sample_apart_and_return_the_n_together():
    from vllm.sampling_params import RequestOutputKind

    sampling = generate.Sampling(n=4, temperature=0.6, top_p=0.9, max_new_tokens=7, seed=42, greedy=True)
    params = [sampling.params(index) for index in range(3)]
    # vLLM draws sample j of a request with seed + j: 42..45, 46..49, 50..53
    assert [p.seed for p in params] == [42, 46, 50]
    assert all(p.n == 4 and p.output_kind == RequestOutputKind.FINAL_ONLY for p in params)
    assert (params[0].temperature, params[0].top_p, params[0].max_tokens, params[0].min_tokens) == (0.6, 0.9, 7, 1)
    greedy = sampling.params(0, greedy=True)
    assert (greedy.n, greedy.temperature, greedy.max_tokens) == (1, 0.0, 7)


def test_model_digest_follows_the_files_contents_not_their_writes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (model / "config.json").write_text('{"hidden_size": 8}')
    digest = inputs.model_digest(str(model))
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)  # the same bytes written again
    (model / ".cache").write_text("anything")  # hidden files are no part of the model
    assert inputs.model_digest(str(model)) == digest
    (model / "model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 4)  # other weights, the same size
    assert inputs.model_digest(str(model)) != digest
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (model / "config.json").write_text('{"hidden_size": 9}')
    assert inputs.model_digest(str(model)) != digest
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").rename(model / "model-1.safetensors")
    assert inputs.model_digest(str(model)) != digest
