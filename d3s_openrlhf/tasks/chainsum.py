"""A built-in task for the down-sampling study: chained addition with a written trace, ``"12+37+25="`` ->
``"12+37=49,49+25=74;74"``.

Design (issue 11, item 2), and why it fits the study:

- Binary reward: 1.0 iff the response ends in ``;`` followed by the exact sum, else 0.0.
- Responses of 20 to 44 characters (one token each, plus EOS): a trace of running sums whose copied parts
  (``49+25=``) are near-deterministic, while a few tokens decide correctness: the tens digit of a running sum
  after a units carry. That is where |A|*H has something to choose: the entropy sits on those tokens.
- An imperfect SFT warm start by construction: in the SFT traces every units carry is dropped with probability
  ``DROP_CARRY`` (the running sum is then 10 too small and the error propagates to the answer). The SFT model
  thus learns an uncertain carry; RL can learn to always carry.
- A spread of difficulty: 3 to 5 terms (2 to 4 additions) of operands 10..49, so a prompt has 0 to 4 carries.
  Under the SFT policy a prompt with c carries is right with probability about (1 - DROP_CARRY)^c: prompts without
  carries are solved by every rollout (zero-variance groups, easy), prompts with 3-4 carries by almost none
  (zero-variance groups, hard); both shares move as RL learns the carry.
- Splits are disjoint for every seed: a problem's split is fixed by a hash of its prompt (10% held-out, 40% rl,
  50% sft); the seed only draws which problems and the SFT noise.
"""

import hashlib
import random

TERMS = (3, 4, 5)
LOW, HIGH = 10, 49
DROP_CARRY = 0.5
MAX_NEW_TOKENS = 48  # longest response: 44 characters, plus EOS
BUCKETS = {"heldout": range(0, 1), "rl": range(1, 5), "sft": range(5, 10)}
# SFT size: the model learns the running sums abruptly after about 28k example passes. 1200 x 4 reached 0.05
# held-out greedy accuracy (format learned, sums not); through OpenRLHF's train_sft in float32 (the CPU launcher's
# --fp32), 4000 x 10 reached 0.25 greedy / 0.30 sampled and 4000 x 12 0.48 / 0.37 (2026-11-24), inside the 0.3-0.6
# the study needs: what is left is the uncertain carry. 4000 x 12 is 1,500 steps, about 5 minutes on 2 CPU cores.
TASK_CONFIG = dict(n_sft=4000, n_prompts=1200, n_heldout=128, sft_epochs=12, sft_lr=1e-3, sft_batch_size=32)


def split_of(prompt):
    bucket = int(hashlib.md5(prompt.encode()).hexdigest(), 16) % 10
    return next(split for split, buckets in BUCKETS.items() if bucket in buckets)


def trace(terms, rng=None):
    """The written trace of ``terms``; with ``rng``, each units carry is dropped with probability DROP_CARRY."""
    total, steps = terms[0], []
    for term in terms[1:]:
        new = total + term
        if rng is not None and (total % 10 + term % 10) >= 10 and rng.random() < DROP_CARRY:
            new -= 10
        steps.append(f"{total}+{term}={new}")
        total = new
    return ",".join(steps) + f";{total}"


def make_examples(split, n, seed):
    rng = random.Random(f"chainsum/{split}/{seed}")
    seen, rows = set(), []
    while len(rows) < n:
        terms = [rng.randint(LOW, HIGH) for _ in range(rng.choice(TERMS))]
        prompt = "+".join(map(str, terms)) + "="
        if prompt in seen or split_of(prompt) != split:
            continue
        seen.add(prompt)
        noisy = trace(terms, rng) if split == "sft" else trace(terms)
        rows.append({"prompt": prompt, "answer": str(sum(terms)), "sft_response": noisy})
    return rows


def reward(response, answer):
    head, sep, final = response.rpartition(";")
    return float(bool(sep) and final == str(answer).strip())
