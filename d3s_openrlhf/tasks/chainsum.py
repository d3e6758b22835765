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
TASK_CONFIG = dict(n_sft=4000, n_prompts=1200, n_heldout=256, sft_epochs=12, sft_lr=1e-3, sft_batch_size=32)


def split_of(prompt):
    bucket = int(hashlib.md5(prompt.encode()).hexdigest(), 16) % 10
    return next(split for split, buckets in BUCKETS.items() if bucket in buckets)


def add(total, term, rng=None, columns=1):
    """``total + term`` written column by column; with ``rng``, each carry out of one of the lowest ``columns`` digit
    columns is dropped with probability DROP_CARRY (the written sum is then ``10 ** (column + 1)`` too small)."""
    written, carry, column = 0, 0, 0
    while total // 10**column or term // 10**column or carry:
        digits = total // 10**column % 10 + term // 10**column % 10 + carry
        carry = int(digits >= 10)
        if carry and column < columns and rng is not None and rng.random() < DROP_CARRY:
            carry = 0
        written += digits % 10 * 10**column
        column += 1
    return written


def trace(terms, rng=None, columns=1):
    """The written trace of ``terms``; with ``rng``, carries dropped as :func:`add` drops them."""
    total, steps = terms[0], []
    for term in terms[1:]:
        new = add(total, term, rng, columns)
        steps.append(f"{total}+{term}={new}")
        total = new
    return ",".join(steps) + f";{total}"


def chain_examples(name, split, n, seed, terms=TERMS, low=LOW, high=HIGH, columns=1):
    """``n`` distinct chains of ``terms`` operands in ``low..high`` of ``split`` (seeded by ``name``, split and
    seed); the SFT split's traces drop carries out of the lowest ``columns`` columns (the other splits' are exact)."""
    rng = random.Random(f"{name}/{split}/{seed}")
    seen, rows = set(), []
    while len(rows) < n:
        chain = [rng.randint(low, high) for _ in range(rng.choice(terms))]
        prompt = "+".join(map(str, chain)) + "="
        if prompt in seen or split_of(prompt) != split:
            continue
        seen.add(prompt)
        noisy = trace(chain, rng, columns) if split == "sft" else trace(chain)
        rows.append({"prompt": prompt, "answer": str(sum(chain)), "sft_response": noisy})
    return rows


def make_examples(split, n, seed):
    return chain_examples("chainsum", split, n, seed)


def reward(response, answer):
    head, sep, final = response.rpartition(";")
    return float(bool(sep) and final == str(answer).strip())
