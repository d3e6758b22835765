"""The built-in study task (d3s_openrlhf.tasks.chainsum): binary reward, disjoint and seeded splits, response
lengths, and the designed spread of difficulty in its SFT traces."""

import collections
import hashlib
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from d3s_openrlhf import tasks
from d3s_openrlhf.tasks import chainsum
from d3s_openrlhf.testbed import toy


def carries(prompt):
    terms = [int(t) for t in prompt[:-1].split("+")]
    total, count = terms[0], 0
    for term in terms[1:]:
        count += (total % 10 + term % 10) >= 10
        total += term
    return count


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+=,;", max_size=50), st.integers(0, 300))
def test_reward_is_binary_and_exact(response, answer):
    value = chainsum.reward(response, str(answer))
    assert value in (0.0, 1.0)
    assert value == float(";" in response and response.rsplit(";", 1)[1] == str(answer))


def test_correct_traces_are_rewarded_and_a_dropped_carry_is_not():
    assert chainsum.trace([12, 37, 25]) == "12+37=49,49+25=74;74"
    assert chainsum.reward("12+37=49,49+25=74;74", "74") == 1.0
    assert chainsum.reward("12+37=49,49+25=64;64", "74") == 0.0
    assert chainsum.reward("74", "74") == 0.0  # no ';' before the answer


def test_rl_and_heldout_targets_are_correct_traces():
    for split in ("rl", "heldout"):
        for row in tasks.examples(chainsum, split, 200, 3):
            assert chainsum.reward(row["sft_response"], row["answer"]) == 1.0
            assert int(row["answer"]) == sum(int(t) for t in row["prompt"][:-1].split("+"))


def test_splits_are_disjoint_across_seeds_and_deterministic():
    prompts = {
        (split, seed): [row["prompt"] for row in chainsum.make_examples(split, 300, seed)]
        for split in tasks.SPLITS
        for seed in (0, 1)
    }
    for seed in (0, 1):
        assert prompts[("sft", seed)] == [r["prompt"] for r in chainsum.make_examples("sft", 300, seed)]
        assert len(set(prompts[("sft", seed)])) == 300
    assert prompts[("rl", 0)] != prompts[("rl", 1)]
    by_split = {split: {p for (s, _), ps in prompts.items() if s == split for p in ps} for split in tasks.SPLITS}
    assert not by_split["sft"] & by_split["rl"] and not by_split["sft"] & by_split["heldout"]
    assert not by_split["rl"] & by_split["heldout"]


def test_examples_are_those_of_the_recorded_studies():
    # the SFT warm starts and the studies in benchmarks/results were built from exactly these examples
    digests = {"sft": "d203002ae49df5b6", "rl": "57e8a0fa235064f5", "heldout": "0140a1840b4eb3a3"}
    for split, digest in digests.items():
        rows = json.dumps(chainsum.make_examples(split, 500, 0)).encode()
        assert hashlib.sha256(rows).hexdigest()[:16] == digest, split


def test_responses_are_at_least_16_tokens_and_fit_the_budget():
    rows = [row for split in tasks.SPLITS for row in chainsum.make_examples(split, 400, 0)]
    characters = sorted({ch for row in rows for ch in row["prompt"] + row["sft_response"]})
    tokenizer = toy.build_tokenizer(characters=characters)
    lengths = [len(tokenizer(row["sft_response"], add_special_tokens=False)["input_ids"]) for row in rows]
    assert min(lengths) >= 16 and max(lengths) + 1 <= chainsum.MAX_NEW_TOKENS


def test_sft_traces_are_partly_wrong_and_harder_with_more_carries():
    rows = chainsum.make_examples("sft", 3000, 0)
    correct = [chainsum.reward(row["sft_response"], row["answer"]) for row in rows]
    assert 0.3 <= sum(correct) / len(correct) <= 0.6
    by_carries = collections.defaultdict(list)
    for row, ok in zip(rows, correct):
        by_carries[carries(row["prompt"])].append(ok)
    rates = {c: sum(v) / len(v) for c, v in by_carries.items()}
    assert rates[0] == 1.0  # no carry: the trace is always right (the easy, zero-variance prompts)
    for c in range(1, 4):  # each carry kept with probability 1 - DROP_CARRY
        assert abs(rates[c] - (1 - chainsum.DROP_CARRY) ** c) < 0.06
