"""Unbiased pass@k from n >= k samples per prompt (Chen et al. 2021, arXiv 2107.03374), and what counts as correct.

For one prompt with n samples of which c are correct, the probability that at least one of k samples drawn
without replacement from the n is correct is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)      (1 when n - c < k)

The product form never forms a binomial coefficient (C(1024, 512) overflows float64), and each factor lies in
[0, 1). A benchmark's pass@k is the mean over its prompts. ``pass@n`` is "any of the n samples is correct"
(what OpenRLHF logs as ``pass{n}``); ``pass@1`` is the mean accuracy over all samples.

A sample is correct iff its reward is at least ``1 - CORRECT_TOLERANCE``: reward 1 counts as correct, reward 0 as
wrong, and so does any other finite value below 1 (a partial credit, e.g. the math reward's format bonus
``w`` for a boxed but wrong answer). A non-finite reward is an error, never counted either way.
"""

from __future__ import annotations

from typing import Iterable, List

import numpy as np

from d3s_openrlhf.core.checks import is_int

CORRECT_TOLERANCE = 1e-6


def is_correct(rewards) -> np.ndarray:
    """Boolean array of the same shape: reward >= 1 - CORRECT_TOLERANCE. ``ValueError`` on a non-finite reward."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if not np.isfinite(rewards).all():
        bad = np.flatnonzero(~np.isfinite(rewards.reshape(-1)))
        raise ValueError(f"non-finite reward at flat position(s) {bad[:8].tolist()}: a reward must be a finite number")
    return rewards >= 1.0 - CORRECT_TOLERANCE


def _check(n, c, k):
    n = np.asarray(n)
    c = np.asarray(c)
    if not (np.issubdtype(n.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
        raise ValueError("pass@k: n and c must be integer counts")
    if not is_int(k) or k < 1:
        raise ValueError(f"pass@k: k must be an integer >= 1, got {k!r}")
    if (n < 1).any():
        raise ValueError("pass@k: every prompt needs n >= 1 samples")
    if (n < k).any():
        raise ValueError(f"pass@k: k = {k} exceeds the number of samples n = {int(n.min())} of a prompt (k <= n)")
    if ((c < 0) | (c > n)).any():
        raise ValueError("pass@k: the number of correct samples c must satisfy 0 <= c <= n")
    return np.broadcast_arrays(n.astype(np.int64), c.astype(np.int64))


def pass_at_k(n, c, k: int) -> np.ndarray:
    """Per-prompt unbiased pass@k, shape of ``broadcast(n, c)``: ``n`` samples and ``c`` correct ones per prompt."""
    n, c = _check(n, c, k)
    if n.size == 0:
        return np.zeros(n.shape, dtype=np.float64)
    flat_n, flat_c = n.reshape(-1), c.reshape(-1)
    # (P, max_n) factors 1 - k/i for i in (n - c, n], 1 elsewhere; rows with n - c < k are 1 by definition
    i = np.arange(1, int(flat_n.max()) + 1, dtype=np.float64)[None, :]
    inside = (i > (flat_n - flat_c)[:, None]) & (i <= flat_n[:, None])
    factors = np.where(inside, 1.0 - k / i, 1.0)
    result = 1.0 - np.prod(factors, axis=1)
    result = np.where(flat_n - flat_c < k, 1.0, result)
    return result.reshape(n.shape)


def mean_pass_at_k(n, c, k: int) -> float:
    """A benchmark's pass@k: the mean of :func:`pass_at_k` over its prompts (``ValueError`` with no prompt)."""
    values = pass_at_k(n, c, k)
    if values.size == 0:
        raise ValueError("pass@k: no prompt to average over")
    return float(values.mean())


def powers_of_two_up_to(n: int) -> List[int]:
    """The k the training-time evaluation reports for n samples: 1, 2, 4, ... <= n, and n itself."""
    ks = [1 << e for e in range(int(n).bit_length()) if (1 << e) <= n]
    return sorted(set(ks) | {int(n)})


def check_ks(ks: Iterable[int], n: int) -> List[int]:
    """The distinct ks in increasing order; ``ValueError`` naming any k outside [1, n]."""
    ks = sorted(set(int(k) for k in ks))
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k = {bad} outside [1, n = {n}]: pass@k needs n >= k samples per prompt")
    return ks
