"""The speed study's second task (d3s_openrlhf.tasks.chainsum_tens): chainsum's format and budget, with uncertain
carries out of the units and the tens, so its SFT traces are right less often than chainsum's."""

import collections

import pytest

from d3s_openrlhf import tasks
from d3s_openrlhf.tasks import chainsum, chainsum_tens
from d3s_openrlhf.testbed import pipeline, toy


def carries(prompt):
    """Carries out of the units and out of the tens over the chain's additions."""
    terms = [int(t) for t in prompt[:-1].split("+")]
    total, count = terms[0], 0
    for term in terms[1:]:
        units = (total % 10 + term % 10) >= 10
        count += units + ((total // 10 % 10 + term // 10 + units) >= 10)
        total += term
    return count


class Draws:
    """A stand-in for the SFT's ``random.Random``: yields ``values`` and counts the draws."""

    def __init__(self, values):
        self.values, self.drawn = list(values), 0

    def random(self):
        self.drawn += 1
        return self.values.pop(0)


@pytest.mark.parametrize(
    "total, term, columns, draws, written",
    [
        (58, 67, 2, [1.0, 1.0], 125),  # both carries kept
        (58, 67, 2, [0.0, 1.0], 115),  # the units' dropped: 10 short (the tens still carry: 5 + 6)
        (58, 67, 2, [1.0, 0.0], 25),  # the tens' dropped: 100 short
        (58, 67, 2, [0.0, 0.0], 15),
        (145, 55, 2, [0.0], 190),  # the units' dropped, the tens no longer carry (4 + 5): one draw
        (58, 67, 1, [0.0], 115),  # chainsum: only the units' carry is uncertain
    ],
)
def test_a_dropped_carry_makes_the_written_sum_short_by_its_column(total, term, columns, draws, written):
    assert chainsum.add(total, term) == total + term
    rng = Draws(draws)
    assert chainsum.add(total, term, rng, columns) == written and rng.drawn == len(draws)


def test_rl_and_heldout_targets_are_correct_traces_within_the_budget():
    for split in ("rl", "heldout"):
        for row in tasks.examples(chainsum_tens, split, 300, 1):
            assert chainsum_tens.reward(row["sft_response"], row["answer"]) == 1.0
    rows = [row for split in tasks.SPLITS for row in chainsum_tens.make_examples(split, 400, 0)]
    characters = sorted({ch for row in rows for ch in row["prompt"] + row["sft_response"]})
    tokenizer = toy.build_tokenizer(characters=characters)
    lengths = [len(tokenizer(row["sft_response"], add_special_tokens=False)["input_ids"]) for row in rows]
    assert min(lengths) >= 16 and max(lengths) + 1 <= chainsum_tens.MAX_NEW_TOKENS
    assert max(int(t) for row in rows for t in row["prompt"][:-1].split("+")) > 49  # two-digit tens carries


def test_sft_traces_are_right_half_as_often_per_carry_and_less_often_than_chainsums():
    rows = chainsum_tens.make_examples("sft", 3000, 0)
    correct = [chainsum_tens.reward(row["sft_response"], row["answer"]) for row in rows]
    by_carries = collections.defaultdict(list)
    for row, ok in zip(rows, correct):
        by_carries[carries(row["prompt"])].append(ok)
    for c in range(0, 5):  # each carry, out of either column, kept with probability 1 - DROP_CARRY
        rate = sum(by_carries[c]) / len(by_carries[c])
        assert abs(rate - (1 - chainsum.DROP_CARRY) ** c) < 0.08, c
    ours = sum(correct) / len(correct)
    theirs = sum(chainsum.reward(r["sft_response"], r["answer"]) for r in chainsum.make_examples("sft", 3000, 0))
    assert 0.1 <= ours <= 0.25 and ours < theirs / 3000 / 2


def test_the_study_can_build_its_files(tmp_path):
    config = pipeline.task_config("d3s_openrlhf.tasks.chainsum_tens", n_sft=50, n_prompts=4000, n_heldout=256)
    files, _, max_new_tokens, _ = pipeline.write_task_files(str(tmp_path), config)
    assert max_new_tokens == chainsum_tens.MAX_NEW_TOKENS
    assert sum(1 for _ in open(files.heldout)) == 256 and sum(1 for _ in open(files.prompts)) == 4000
