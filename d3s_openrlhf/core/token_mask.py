"""Token-level down-sampling of D3S (arXiv 2509.22115): keep the tokens with the largest |A_{i,t}| * H_{i,t}.

Rules (shared by both scopes):

* Only positions where ``action_mask`` is true are candidates; the others are never kept.
* Budget: b = ceil(K * n) for n candidate tokens (the whole batch for ``scope="batch"``, each row for
  ``scope="sequence"``), and at least 1 whenever n >= 1. K is read as the nearest fraction with a denominator
  of at most 10**6 (exact for every decimal with up to six places), so the ceiling is computed exactly:
  K = 0.07 of 100 tokens keeps 7, not the 8 that the binary double 0.07 * 100 = 7.000000000000001 would give.
* Signal: a token whose score is not > 0 (advantage 0, entropy 0) carries no policy-gradient signal and is
  never kept, so k = min(b, number of candidates with score > 0): the budget is not filled up with zero-score
  tokens, which would only inflate the kept-token normaliser. K = 1 therefore keeps every candidate with a
  positive score, not the whole action_mask; "no token mask" (upstream's loss) is the caller's K = 1 path,
  which does not call this function.
* Order: every kept token's score is >= every dropped candidate's score. Among tokens tied at the cut-off
  score the earliest positions win (row-major order: lower row first, then lower column), i.e. the result is
  what a stable descending sort followed by taking the first k gives. The rule is deterministic and needs no
  random state; ties in the score are rare in practice since it multiplies an advantage by a float entropy.
* Scores are computed in at least fp32; a NaN or infinite score at a candidate position raises ValueError.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Dict, Optional

import torch

from d3s_openrlhf.core.checks import is_real

TOKEN_SCOPES = ("batch", "sequence")

_MAX_FRACTION_DENOMINATOR = 10**6


def _keep_counts(fraction: float, candidates: torch.Tensor) -> torch.Tensor:
    """ceil(fraction * candidates), elementwise on an int64 tensor, with at least 1 where candidates >= 1."""
    ratio = Fraction(fraction).limit_denominator(_MAX_FRACTION_DENOMINATOR)
    counts = (candidates * ratio.numerator + (ratio.denominator - 1)) // ratio.denominator
    return torch.maximum(counts, candidates.clamp(max=1))


def _validate(advantages, entropy, action_mask, fraction, scope) -> torch.Tensor:
    for name, tensor in (("advantages", advantages), ("entropy", entropy), ("action_mask", action_mask)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor")
        if tensor.dim() != 2:
            raise ValueError(f"{name} must have shape (S, T), got shape {tuple(tensor.shape)}")
    if not (advantages.shape == entropy.shape == action_mask.shape):
        raise ValueError(
            "advantages, entropy and action_mask must have the same shape, got "
            f"{tuple(advantages.shape)}, {tuple(entropy.shape)} and {tuple(action_mask.shape)}"
        )
    if not is_real(fraction) or not (0.0 < float(fraction) <= 1.0):
        raise ValueError(f"fraction must be a real number in (0, 1], got {fraction!r}")
    if scope not in TOKEN_SCOPES:
        raise ValueError(f"scope must be one of {', '.join(TOKEN_SCOPES)}, got {scope!r}")
    return action_mask if action_mask.dtype == torch.bool else action_mask != 0


def _token_scores(advantages: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """|advantages| * entropy in at least fp32 (the selection score s_{i,t} of D3S)."""
    dtype = torch.promote_types(torch.promote_types(advantages.dtype, entropy.dtype), torch.float32)
    return advantages.to(dtype).abs() * entropy.to(dtype)


def token_keep_mask(
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    action_mask: torch.Tensor,
    fraction: float,
    *,
    scope: str = "batch",
) -> torch.Tensor:
    """Bool (S, T) mask of the tokens kept for the policy-gradient term (see the module docstring).

    Args:
        advantages: (S, T) per-token advantages A_{i,t}.
        entropy: (S, T) per-token policy entropy H_{i,t}.
        action_mask: (S, T) response-token mask (bool; other dtypes: nonzero = valid).
        fraction: K in (0, 1]; 1 keeps every valid token with a positive score.
        scope: "batch" (one budget over all rows) or "sequence" (a budget per row).
    """
    mask = _validate(advantages, entropy, action_mask, fraction, scope)
    scores = _token_scores(advantages, entropy)
    if not bool(torch.isfinite(scores).logical_or(~mask).all()):
        raise ValueError("token scores |advantages| * entropy must be finite at every action_mask position")
    fraction = float(fraction)
    if scope == "sequence":
        return _sequence_mask(scores, mask, fraction)
    return _batch_mask(scores, mask, fraction)


def _batch_mask(scores: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    flat_scores = scores.reshape(-1)
    flat_mask = mask.reshape(-1)
    signal = flat_mask & (flat_scores > 0)
    positives = flat_scores[signal]
    total = positives.numel()
    keep = min(int(_keep_counts(fraction, flat_mask.sum().cpu())), total)
    if keep == total:
        return signal.reshape(mask.shape)
    # The keep-th largest positive score is the cut-off; the strictly larger ones are all kept, and the
    # remaining places go to the earliest positions that tie with the cut-off.
    cutoff = torch.kthvalue(positives, total - keep + 1).values
    above = flat_mask & (flat_scores > cutoff)
    places_left = keep - int(above.sum())
    tied = flat_mask & (flat_scores == cutoff)
    kept = above | (tied & (tied.cumsum(0) <= places_left))
    return kept.reshape(mask.shape)


def _sequence_mask(scores: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    signal = mask & (scores > 0)
    keep_per_row = torch.minimum(_keep_counts(fraction, mask.sum(dim=1)), signal.sum(dim=1))
    # Positive scores sort first, in descending order (the others are -inf); the stable sort puts ties in
    # column order.
    keys = scores.masked_fill(~signal, float("-inf"))
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices
    rank = torch.arange(mask.shape[1], device=mask.device)
    kept_in_sorted_order = rank.unsqueeze(0) < keep_per_row.unsqueeze(1)
    return torch.zeros_like(mask).scatter(1, order, kept_in_sorted_order)


def token_mask_metrics(
    keep: torch.Tensor, action_mask: torch.Tensor, entropy: torch.Tensor, advantages: Optional[torch.Tensor] = None
) -> Dict[str, float]:
    """Summary numbers for logging a token mask: counts, kept fraction, mean entropy of all vs kept tokens, and
    with ``advantages`` (the ones the mask was chosen from) ``scored_tokens``, the candidates whose score
    |A| * H is > 0 (at most these can be kept).

    Means over an empty set are reported as 0.0.
    """
    if not (keep.shape == action_mask.shape == entropy.shape):
        raise ValueError(
            "keep, action_mask and entropy must have the same shape, got "
            f"{tuple(keep.shape)}, {tuple(action_mask.shape)} and {tuple(entropy.shape)}"
        )
    valid = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    kept = keep.bool() & valid
    entropy = entropy.float()
    valid_tokens = int(valid.sum())
    kept_tokens = int(kept.sum())
    metrics = {
        "valid_tokens": float(valid_tokens),
        "kept_tokens": float(kept_tokens),
        "kept_fraction": kept_tokens / valid_tokens if valid_tokens else 0.0,
        "entropy_mean_all": float(entropy[valid].sum()) / valid_tokens if valid_tokens else 0.0,
        "entropy_mean_kept": float(entropy[kept].sum()) / kept_tokens if kept_tokens else 0.0,
    }
    if advantages is not None:
        metrics["scored_tokens"] = float(((_token_scores(advantages, entropy) > 0) & valid).sum())
    return metrics
