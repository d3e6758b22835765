"""Group-relative scalar advantages (shaped rewards) over full groups or over the kept members of each group.

``kept=None`` reproduces the baselines of OpenRLHF 0.11.2 (``RemoteExperienceMaker.compute_advantages_and_returns``)
with the same tensor operations in the same order, so the result is bit-identical to upstream for a group size
G >= 2 (rewards are first promoted to at least fp32, as upstream does):

    group_norm          (r - mean(r)) / (std(r) + 1e-9)        std unbiased (torch.std default)
    dr_grpo             r - mean(r)
    reinforce_baseline  r - mean(r)                           (upstream whitens later, over tokens)
    rloo                r - (sum(r) - r) / (G - 1)

With ``kept`` (bool (B, G)) the statistics of each row use only its kept members (PODS recomputes advantages
over the selected subset this way): with c kept members, mean over them, unbiased std with c - 1, leave-one-out
over c - 1. Our rules where the formulas are undefined (documented choices):

* a row with a single kept member (or G == 1 with ``kept=None``) has no baseline to compare against: its
  advantage is 0 (upstream's formulas would give NaN for group_norm and rloo);
* a row with no kept member contributes nothing; entries that are not kept are 0;
* group_norm keeps OpenRLHF's eps of 1e-9 (PODS's own code uses 1e-4), so a fully kept row equals the
  ``kept=None`` value up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch


@dataclass(frozen=True)
class Estimator:
    """A group-relative estimator: its baseline (the group mean, or leave-one-out) and whether the centred reward
    is divided by the group's std."""

    leave_one_out: bool = False
    std_scaled: bool = False

    @property
    def needs_two(self) -> bool:
        """Undefined on a single member (division by G - 1): such a group gets advantage 0."""
        return self.leave_one_out or self.std_scaled


ESTIMATORS: Mapping[str, Estimator] = MappingProxyType(
    {
        "group_norm": Estimator(std_scaled=True),
        "dr_grpo": Estimator(),
        "rloo": Estimator(leave_one_out=True),
        "reinforce_baseline": Estimator(),
    }
)
ADVANTAGE_ESTIMATORS = tuple(ESTIMATORS)

_GROUP_NORM_EPS = 1e-9


def _full_group(rewards: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    group_size = rewards.shape[-1]
    if group_size == 1 and estimator.needs_two:
        return torch.zeros_like(rewards)
    if estimator.leave_one_out:
        baseline = (rewards.sum(-1, keepdim=True) - rewards) / (group_size - 1)
    else:
        baseline = rewards.mean(-1, keepdim=True)
    centred = rewards - baseline
    if estimator.std_scaled:
        return centred / (rewards.std(-1, keepdim=True) + _GROUP_NORM_EPS)
    return centred


def _kept_subset(rewards: torch.Tensor, estimator: Estimator, kept: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    kept_rewards = torch.where(kept, rewards, zero)
    count = kept.sum(-1, keepdim=True).to(rewards.dtype)
    total = kept_rewards.sum(-1, keepdim=True)
    has_baseline = kept & (count >= 2)
    if estimator.leave_one_out:
        baseline = (total - kept_rewards) / (count - 1).clamp(min=1)
    else:
        baseline = total / count.clamp(min=1)
    centred = kept_rewards - baseline
    if estimator.std_scaled:
        squares = torch.where(kept, centred, zero).pow(2).sum(-1, keepdim=True)
        std = (squares / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + _GROUP_NORM_EPS)
    return torch.where(has_baseline, centred, zero)


def group_advantages(rewards: torch.Tensor, estimator: str, kept: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scalar advantages of shape (B, G) from rewards of shape (B, G) (one row per prompt).

    Args:
        rewards: (B, G) tensor; promoted to at least fp32 (never modified in place).
        estimator: one of ``group_norm``, ``dr_grpo``, ``rloo``, ``reinforce_baseline``.
        kept: optional bool (B, G) tensor; when given, statistics use only the kept members of each row and the
            entries that are not kept are 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        raise ValueError("rewards must be a 2-D tensor of shape (B, G)")
    if rewards.shape[1] < 1:
        raise ValueError("rewards must have at least one column (G >= 1)")
    # Upstream groups a contiguous (B*G,) tensor with reshape(-1, G): contiguous memory keeps the reductions'
    # summation order, and so the bits, the same.
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).contiguous()
    if kept is None:
        return _full_group(rewards, ESTIMATORS[estimator])
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool:
        raise ValueError("kept must be a bool tensor")
    if kept.shape != rewards.shape:
        raise ValueError(f"kept has shape {tuple(kept.shape)} but rewards have shape {tuple(rewards.shape)}")
    return _kept_subset(rewards, ESTIMATORS[estimator], kept.to(rewards.device))
