"""The testbed's default task (``tasks.DEFAULT_TASK``, the end-to-end tests' toy runs): integer addition
``"12+7="`` -> ``"19"``, operands 0..29, exact-match reward.

Responses are at most 3 digits (plus EOS) and the SFT target is the exact answer. The split boundaries are fixed
(sft: the first 420 of a seeded permutation of the 900 problems, rl: the next 400, heldout: the last 80), so the
splits are disjoint for any ``n`` and a split of size ``n`` is a prefix of the larger ones.
"""

import random

MAX_OPERAND = 29
SPLIT_SIZES = {"sft": 420, "rl": 400, "heldout": 80}
MAX_NEW_TOKENS = 4  # up to 3 digits and EOS
CHARACTERS = tuple("0123456789+=")  # the vocabulary order of the results in benchmarks/RESULTS.md


def problems(max_operand, count, seed):
    """``count`` distinct problems ``(a, b)`` with ``0 <= a, b <= max_operand``, in a seeded random order."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if count > len(pairs):
        raise ValueError(f"only {len(pairs)} problems with operands <= {max_operand}")
    random.Random(seed).shuffle(pairs)
    return pairs[:count]


def prompt_of(a, b):
    return f"{a}+{b}="


def make_examples(split, n, seed):
    if n > SPLIT_SIZES[split]:
        raise ValueError(f"the addition task has {SPLIT_SIZES[split]} {split} problems, asked for {n}")
    start = {"sft": 0, "rl": SPLIT_SIZES["sft"], "heldout": SPLIT_SIZES["sft"] + SPLIT_SIZES["rl"]}[split]
    pairs = problems(MAX_OPERAND, sum(SPLIT_SIZES.values()), seed)[start : start + n]
    return [{"prompt": prompt_of(a, b), "answer": str(a + b), "sft_response": str(a + b)} for a, b in pairs]


def reward(response, answer):
    return float(response == str(answer).strip())
