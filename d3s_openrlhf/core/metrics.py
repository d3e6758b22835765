"""The ``d3s/*`` metrics of one rollout step, from what the step selected (pure; logged by the trainer).

Keys (all floats; ``train/d3s/*`` in wandb / tensorboard):

* ``d3s/n``, ``d3s/k``: the schedule point (N rollouts per prompt, K fraction of tokens);
* ``d3s/kept_rollouts`` and ``d3s/kept_rollout_frac`` (of the B*G generated);
* ``d3s/candidate_tokens``: response tokens of the kept rollouts, what K applies to;
* ``d3s/scored_tokens``: of those, the ones with a non-zero score |A|*H, at most these can be kept (steps with
  a token mask);
* ``d3s/kept_tokens``: tokens entering the policy-gradient term, and ``d3s/kept_token_frac`` of the response
  tokens of all B*G rollouts;
* ``d3s/adv_var_all`` / ``d3s/adv_var_kept``: population variance of the per-rollout scalar advantage over all
  rollouts (full-group estimator) / over the kept ones as trained (group estimators only);
* ``d3s/entropy_all`` / ``d3s/entropy_kept``: mean old-policy entropy over the candidate tokens / over the kept
  tokens (steps with a token mask);
* ``d3s/zero_var_groups``: prompts whose G rewards are all equal (every advantage 0, no policy-gradient signal).

:func:`logprob_gap` is the sampling engine's distance from the trainer on the tokens it sampled (``lora/engine_gap``,
``integration/engine_gap.py``).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch


@torch.no_grad()
def step_metrics(
    n: int,
    k: float,
    rewards: torch.Tensor,
    kept_rollouts: int,
    candidate_tokens: int,
    all_tokens: int,
    advantages: Optional[torch.Tensor] = None,
    kept_advantages: Optional[torch.Tensor] = None,
    token_stats: Optional[Mapping[str, float]] = None,
) -> Dict[str, float]:
    """The step's ``d3s/*`` metrics (see the module docstring).

    Args:
        n, k: the step's schedule point.
        rewards: (B, G) rewards of all rollouts (after length penalties).
        kept_rollouts: rollouts trained, of B*G.
        candidate_tokens: response tokens of the kept rollouts; ``all_tokens``: of all B*G rollouts.
        advantages: (B*G,) full-group scalar advantages, and ``kept_advantages`` (kept,) those trained; both or
            neither (an estimator without group advantages).
        token_stats: ``token_mask_metrics`` of the step's token mask with its advantages (``scored_tokens``), or
            None when no token mask was built (K = 1).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, G), got shape {tuple(rewards.shape)}")
    if (advantages is None) != (kept_advantages is None):
        raise ValueError("give both advantages and kept_advantages, or neither")
    metrics = {
        "d3s/n": float(n),
        "d3s/k": float(k),
        "d3s/kept_rollouts": float(kept_rollouts),
        "d3s/kept_rollout_frac": kept_rollouts / rewards.numel(),
    }
    kept_tokens = float(candidate_tokens)
    if token_stats is not None:
        metrics["d3s/entropy_all"] = token_stats["entropy_mean_all"]
        metrics["d3s/entropy_kept"] = token_stats["entropy_mean_kept"]
        metrics["d3s/scored_tokens"] = token_stats["scored_tokens"]
        kept_tokens = token_stats["kept_tokens"]
    metrics["d3s/candidate_tokens"] = float(candidate_tokens)
    metrics["d3s/kept_tokens"] = kept_tokens
    metrics["d3s/kept_token_frac"] = kept_tokens / all_tokens if all_tokens else 0.0
    if advantages is not None:
        metrics["d3s/adv_var_all"] = advantages.double().var(unbiased=False).item()
        metrics["d3s/adv_var_kept"] = kept_advantages.double().var(unbiased=False).item()
    if rewards.shape[1] > 1:
        metrics["d3s/zero_var_groups"] = float((rewards.amax(-1) == rewards.amin(-1)).sum())
    return metrics


@torch.no_grad()
def logprob_gap(
    action_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """Token mean of |log pi_trainer(a_t) - log pi_engine(a_t)| over the generated tokens (0-d float32; 0 when
    ``action_mask`` marks none).

    Args:
        action_log_probs: (B, A) the trainer's log-probs of the sampled tokens.
        rollout_log_probs: (B, A) the engine's log-probs of the same tokens, as it sampled them.
        action_mask: (B, A) the generated tokens (bool or 0/1).
    """
    if action_log_probs.shape != rollout_log_probs.shape or action_log_probs.shape != action_mask.shape:
        raise ValueError(
            f"log-probs and mask must share one (B, A) shape, got {tuple(action_log_probs.shape)}, "
            f"{tuple(rollout_log_probs.shape)} and {tuple(action_mask.shape)}"
        )
    mask = action_mask.bool()
    gap = (action_log_probs.float() - rollout_log_probs.float()).abs()
    return torch.where(mask, gap, 0.0).sum() / mask.sum().clamp(min=1)
