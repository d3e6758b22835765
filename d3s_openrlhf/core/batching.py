"""Kept-rollout counts that OpenRLHF can split evenly (pure integer arithmetic).

OpenRLHF hands the experience-making forwards to the data-parallel ranks in chunks of
``rollout.micro_batch_size`` and trains in whole windows of ``train.batch_size`` samples; a kept count that
does not divide evenly gives ranks different numbers of micro-batches (a hang under ZeRO-3) or silently drops
a remainder. Our rule for the unit every kept count must be a multiple of:

* without dynamic batching: lcm(train.batch_size, rollout.micro_batch_size * dp)
* with ``--train.dynamic_batch_enable``: lcm(train.batch_size, dp)

where dp = actor nodes * GPUs per node / ring_attn_size / tensor_parallel_size. The schedule's target N(p) * B
is rounded UP to the next multiple (the selection then takes the next-best rollouts). In intra scope the extra
rollouts are spread one per prompt over prompts drawn by a seeded generator (``intra_counts``).

How the kept rollouts become optimizer steps (``OPTIMIZER_STEP_MODES``, ``--d3s.optimizer_steps``):

* ``fixed_batch`` (OpenRLHF's rule): one optimizer step per ``train.batch_size`` kept rollouts, so a rollout step
  that keeps fewer rollouts takes fewer steps; the unit above, with train.batch_size.
* ``fixed_updates``: every rollout step takes U = B*G / train.batch_size optimizer steps per epoch, as training all
  B*G rollouts would, each on kept / U rollouts. Every one of the U optimizer batches must then be a whole number
  of micro-batches on every rank, so train.batch_size is replaced in the unit by :func:`fixed_updates_unit`:
  U * train.micro_batch_size * dp (dynamic batching: U * dp, upstream packs the micro-batches).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from d3s_openrlhf.core.checks import require_int

OPTIMIZER_STEP_MODES = ("fixed_batch", "fixed_updates")


def kept_unit(train_batch_size: int, rollout_micro_batch_size: int, dp_size: int, dynamic_batch: bool) -> int:
    """The number every kept-rollout count must be a multiple of (see the module docstring); with fixed updates,
    ``train_batch_size`` is :func:`fixed_updates_unit`."""
    train_batch_size = require_int("train_batch_size", train_batch_size, 1)
    rollout_micro_batch_size = require_int("rollout_micro_batch_size", rollout_micro_batch_size, 1)
    dp_size = require_int("dp_size", dp_size, 1)
    if not isinstance(dynamic_batch, bool):
        raise ValueError(f"dynamic_batch must be a bool, got {dynamic_batch!r}")
    if dynamic_batch:
        return math.lcm(train_batch_size, dp_size)
    return math.lcm(train_batch_size, rollout_micro_batch_size * dp_size)


def updates_per_rollout_step(total: int, train_batch_size: int) -> int:
    """U = total / train_batch_size: the optimizer steps per epoch of a rollout step that trains all ``total``
    (B * G) rollouts, the number every rollout step takes with fixed updates."""
    total = require_int("total", total, 1)
    train_batch_size = require_int("train_batch_size", train_batch_size, 1)
    if total % train_batch_size:
        raise ValueError(f"{total} rollouts are not a whole number of optimizer batches of {train_batch_size}")
    return total // train_batch_size


def fixed_updates_unit(updates: int, train_micro_batch_size: int, dp_size: int, dynamic_batch: bool) -> int:
    """The multiple of kept rollouts that ``updates`` optimizer steps split into equal optimizer batches of whole
    micro-batches on each of ``dp_size`` ranks (see the module docstring)."""
    updates = require_int("updates", updates, 1)
    train_micro_batch_size = require_int("train_micro_batch_size", train_micro_batch_size, 1)
    dp_size = require_int("dp_size", dp_size, 1)
    if not isinstance(dynamic_batch, bool):
        raise ValueError(f"dynamic_batch must be a bool, got {dynamic_batch!r}")
    return updates * dp_size * (1 if dynamic_batch else train_micro_batch_size)


def legal_kept_count(target: int, total: int, unit: int, minimum: int = 1) -> int:
    """The smallest multiple of ``unit`` that is >= max(target, minimum); never more than ``total``.

    ``total`` (all B * G rollouts) must itself be a multiple of ``unit`` (OpenRLHF needs that to train the
    full batch), which also guarantees that the result exists for any target <= total.
    """
    target = require_int("target", target, 0)
    total = require_int("total", total, 1)
    unit = require_int("unit", unit, 1)
    minimum = require_int("minimum", minimum, 1)
    if unit > total:
        raise ValueError(f"unit {unit} is larger than the total of {total} rollouts: no legal kept count exists")
    if total % unit:
        raise ValueError(f"total {total} is not a multiple of unit {unit}")
    wanted = max(target, minimum)
    if wanted > total:
        raise ValueError(f"cannot keep {wanted} of {total} rollouts (target {target}, minimum {minimum})")
    return -(-wanted // unit) * unit


def intra_counts(kept: int, n: int, num_prompts: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Per-prompt kept counts (LongTensor of shape (num_prompts,)) summing to ``kept``.

    Every prompt keeps ``n``; the r = kept - n * num_prompts (0 <= r <= num_prompts) remaining rollouts go one
    each to r distinct prompts drawn uniformly without replacement from ``generator`` (the global RNG when
    None), so which prompts get the extra one does not depend on their position in the batch. The generator is
    only advanced when r > 0; it may live on any device (the draw happens there), the counts are on the CPU.
    """
    kept = require_int("kept", kept, 0)
    n = require_int("n", n, 0)
    num_prompts = require_int("num_prompts", num_prompts, 1)
    extra = kept - n * num_prompts
    if not 0 <= extra <= num_prompts:
        raise ValueError(
            f"kept={kept} cannot be split as {n} or {n + 1} per prompt over {num_prompts} prompts "
            f"(needs {n * num_prompts} <= kept <= {(n + 1) * num_prompts})"
        )
    counts = torch.full((num_prompts,), n, dtype=torch.long)
    if extra:
        device = "cpu" if generator is None else generator.device
        counts[torch.randperm(num_prompts, generator=generator, device=device)[:extra].cpu()] += 1
    return counts
