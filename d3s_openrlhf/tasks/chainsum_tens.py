"""The speed study's second task: chained addition of two-digit operands, with uncertain carries out of the units
and the tens, ``"58+67+94="`` -> ``"58+67=125,125+94=219;219"``.

Why this task (issue 38, item 5): on chainsum GRPO saturates early, between 0.8 and 0.9 held-out greedy by step 50
to 100 of 150, so a time to a fixed accuracy is decided by the first few evaluations. This task keeps chainsum's
format, reward, splits and response budget (at most 46 characters, so a step costs about the same), and changes only
what RL has to learn:

- operands 10..99 instead of 10..49, so a sum carries out of the tens as well as out of the units (into 3-digit
  running sums, up to 495);
- the SFT traces drop each carry out of either column with probability ``chainsum.DROP_CARRY`` (0.5): a prompt
  has 0 to 8 uncertain carries (mostly 2 to 5) against chainsum's 0 to 4 (mostly 1 to 2).

A warm start that imitates its traces, as chainsum's did (0.446 expected; 0.445 and 0.48 measured), is right on a
prompt with c carries with probability 0.5^c: about 0.17 held-out greedy on average here, against chainsum's 0.45, with
many prompts right in a few of 16 rollouts (signal, but a long way up). A different operation (multiplication,
subtraction with borrows) would change the response lengths and the skills the SFT must learn from scratch; a
longer chain would lengthen every response and every step.

Calibration (2026-11-27, 2 CPU cores, the speed study's fresh regime, ``benchmarks/bench_speed.py``): with
chainsum's SFT sizes the warm start is 0.270 held-out greedy (greedy decoding resolves more carries than a fair
coin); GRPO, seed 0, from it: at lr 5e-5 0.55 at step 10, 0.66 at step 30, still climbing at the end (0.73 at
step 140), which is what the task is for; at 1e-4 0.54 at step 10, then flat between 0.45 and 0.59; at 2e-4 it
collapsed (0.00 from step 60). So the SFT sizes stay chainsum's.
"""

from d3s_openrlhf.tasks import chainsum

TERMS = (3, 4, 5)
LOW, HIGH = 10, 99
COLUMNS = 2  # carries out of the units and the tens are uncertain in the SFT traces
MAX_NEW_TOKENS = 48  # longest response: "99+99=198,198+99=297,297+99=396,396+99=495;495", 46 characters, plus EOS
TASK_CONFIG = dict(n_sft=4000, n_prompts=1200, n_heldout=256, sft_epochs=12, sft_lr=1e-3, sft_batch_size=32)


def make_examples(split, n, seed):
    return chainsum.chain_examples("chainsum_tens", split, n, seed, TERMS, LOW, HIGH, COLUMNS)


reward = chainsum.reward
