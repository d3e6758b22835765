"""The token-level PG loss of D3S: upstream's ``PolicyLoss`` (``openrlhf/models/loss.py``) restricted to the kept
tokens, the pg masks it reads, and the kept-token normalisers of each optimizer-step window.

Loss semantics (m = pg mask AND action mask, the "kept" tokens; l_t = upstream's per-token clipped surrogate):

* token-level (``--actor.loss_agg_mode token-mean``):
  ``pg_loss = dp_size * sum_{kept t in this micro-batch} l_t / (kept tokens of the optimizer-step window over all
  DP ranks / gas)``, i.e. after DeepSpeed's 1/gas scaling and DP gradient averaging, one mean over all kept tokens
  of the optimizer step: the same invariance to DP sharding and gradient accumulation as upstream's token mean.
* sequence-level (``seq-mean-token-mean``, and GSPO which forces it): each sequence's loss is the mean of l_t over
  its kept tokens; sequences are averaged over those with at least one kept token in the window (over all DP
  ranks, / gas). A sequence without kept tokens contributes nothing and is not counted.
* A window without any kept token (or kept sequence) trains no PG term: the term is exactly 0 with zero gradient
  (its normaliser 0 is replaced by 1 over a numerator that is exactly 0), while the KL and entropy terms act as
  upstream's. Such windows are common without shuffling (ring attention, tensor parallelism, dynamic batching)
  or when every reward of a batch is equal.
* Implementation: the surrogate is positively homogeneous in the advantage (for c >= 0, l_t(c * A) = c * l_t(A),
  including the dual clip, whose branch depends only on the sign of A), so upstream's own ``PolicyLoss`` is called
  with ``A * m`` (token level) or ``A * m * n_i / k_i`` (sequence level, n_i / k_i = response / kept tokens of row
  i) and with the kept-token normalisers in place of the full ones. Dropped tokens then have a zero advantage and
  receive no PPO-surrogate gradient.
* GSPO: the sequence ratio exp(mean log-ratio) stays over the full response (upstream's formula), so with GSPO the
  dropped tokens of a sequence that keeps some tokens still receive gradient through that ratio; sequences with no
  kept token receive none.
* The KL loss (``--algo.kl.use_loss``) and the entropy loss keep the full action mask and upstream's normalisers:
  the regularisers are not part of the selection. The logged ``ppo_clip_ratio`` is over all response tokens
  (dropped tokens count as not clipped); ``ppo_kl`` and the IS-correction statistics are upstream's, over all
  response tokens.
* Without a pg mask (key absent) every method here runs exactly upstream's code path, and an all-ones mask gives
  bit-identical losses and gradients.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from openrlhf.models import PolicyLoss
from openrlhf.utils.loss_utils import _get_dp_group, _optimizer_step_loss_norm
from torch.nn.utils.rnn import pad_sequence

from d3s_openrlhf.core.checks import check_on_device
from d3s_openrlhf.integration.host import PG_MASK_KEY

PG_NORM_ATTR = "d3s_pg_loss_norm"
"""Attribute that the window iterator sets on each training micro-batch: its window's kept-token normalisers."""

WINDOW_END_ATTR = "d3s_window_end"
"""Attribute that the window iterator sets on each training micro-batch: whether it is the last of its window (the
optimizer step's gradient-accumulation boundary)."""

_NORM_KEYS = ("batch_num_tokens", "global_batch_size")


# ---------------------------------------------------------------------------------------------------------------
# pg masks


def pg_mask_from_rows(rows: Union[Sequence[torch.Tensor], torch.Tensor], action_mask: torch.Tensor) -> torch.Tensor:
    """Rebuild the (B, A) pg mask of a (re-padded) micro-batch from its per-sample rows.

    Each row is aligned with its sample's action-mask row from the left (OpenRLHF right-pads responses and trims
    only trailing padding), but may be wider or narrower than ``action_mask``'s width A: it is cut or padded with
    False to A. The result is ANDed with ``action_mask``. A row that keeps a token beyond A is refused without a
    host sync (``core.checks.check_on_device``): the rows are on the GPU at every training micro-batch.
    """
    if len(rows) != action_mask.shape[0]:
        raise ValueError(f"{len(rows)} pg-mask rows for a micro-batch of {action_mask.shape[0]} samples")
    width = action_mask.shape[1]
    mask = torch.zeros(action_mask.shape, dtype=torch.bool, device=action_mask.device)
    if not len(rows):
        return mask
    # (B, L), False past each row's end
    grid = rows if isinstance(rows, torch.Tensor) else pad_sequence([r.reshape(-1).bool() for r in rows], True)
    grid = grid.reshape(len(rows), -1).to(device=mask.device, dtype=torch.bool)
    if grid.shape[1] > width:
        aligned = ~grid[:, width:].any()
        check_on_device(
            aligned, f"a pg-mask row keeps tokens beyond the response width {width}: it is not aligned with action_mask"
        )
    n = min(width, grid.shape[1])
    mask[:, :n] = grid[:, :n]
    return mask & action_mask.bool()


def experience_pg_mask(experience) -> torch.Tensor:
    """The tokens that enter the PG surrogate: the rebuilt pg mask, or the action mask when there is none.

    Works on a micro-batch ((B, A) action mask, one row per sample) and on a replay-buffer item (one sample: a 1-D
    action mask and a single row)."""
    action_mask, rows = experience.action_mask, experience.info.get(PG_MASK_KEY)
    if rows is None:
        return action_mask
    if action_mask.dim() == 1:
        return pg_mask_from_rows([rows], action_mask[None])[0]
    return pg_mask_from_rows(rows, action_mask)


# ---------------------------------------------------------------------------------------------------------------
# the loss


def _nonzero(normaliser):
    """``normaliser`` (a float or a 0-d tensor), or 1 where it is 0."""
    if isinstance(normaliser, torch.Tensor):
        return torch.where(normaliser != 0, normaliser, torch.ones_like(normaliser))
    return normaliser if normaliser != 0 else 1.0


class D3SPolicyLoss(PolicyLoss):
    """``PolicyLoss`` whose PG surrogate covers only the kept tokens while ``selecting`` is active.

    Outside ``selecting`` it is upstream's loss, unchanged. See the module docstring for the exact semantics.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._selection = None

    @property
    def selection(self):
        """``(pg_mask, batch_num_tokens, global_batch_size)`` while ``selecting`` is active, else None."""
        return self._selection

    @contextmanager
    def selecting(self, pg_mask: torch.Tensor, batch_num_tokens, global_batch_size) -> Iterator[None]:
        """Within the block, calls use ``pg_mask`` (bool, shaped like action_mask) and the kept-token
        normalisers: ``batch_num_tokens`` (kept tokens of the optimizer-step window over all DP ranks / gas) and
        ``global_batch_size`` (sequences with >= 1 kept token, same window and scaling)."""
        if batch_num_tokens is None or global_batch_size is None:
            raise ValueError("a pg mask needs both kept-token normalisers (batch_num_tokens, global_batch_size)")
        self._selection = (pg_mask, batch_num_tokens, global_batch_size)
        try:
            yield
        finally:
            self._selection = None

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ):
        if self._selection is not None:
            pg_mask, batch_num_tokens, global_batch_size = self._selection
            if action_mask is None or pg_mask.shape != action_mask.shape:
                raise ValueError(
                    f"pg mask of shape {tuple(pg_mask.shape)} does not match action_mask "
                    f"{None if action_mask is None else tuple(action_mask.shape)}"
                )
            kept = pg_mask.bool() & action_mask.bool()
            if self.token_level_loss:
                scale = kept.to(advantages.dtype)
            else:
                # per row: response tokens / kept tokens, so upstream's per-sequence token mean becomes a mean
                # over the kept tokens
                full = action_mask.sum(dim=-1, keepdim=True).to(advantages.dtype)
                n_kept = kept.sum(dim=-1, keepdim=True).to(advantages.dtype)
                scale = torch.where(kept, full / n_kept.clamp(min=1), 0.0)
            advantages = advantages * scale
            # A window without kept tokens (sequences) has a PG numerator of exactly 0, every advantage being 0:
            # dividing it by 1 instead of 0 keeps the term and its gradient 0 instead of NaN.
            batch_num_tokens = _nonzero(batch_num_tokens)
            global_batch_size = _nonzero(global_batch_size)
        return super().forward(
            log_probs,
            old_log_probs,
            advantages,
            action_mask=action_mask,
            rollout_log_probs=rollout_log_probs,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
        )


# ---------------------------------------------------------------------------------------------------------------
# normalisers per optimizer-step window


def with_pg_window_norms(upstream_iter):
    """Wrap ``iter_grad_accum_global_norm`` so that each yielded micro-batch also carries its window's kept-token
    normalisers (attribute ``d3s_pg_loss_norm``: ``{"batch_num_tokens", "global_batch_size"}``) and whether it ends
    its window (attribute ``d3s_window_end``).

    The upstream iterator is used as is (it defines the windows, including a trailing partial one, and its
    normalisers are yielded unchanged); it calls ``mask_fn`` on every item of a window before yielding the first
    of them, so the pg masks collected through ``mask_fn`` since the last yield are exactly that window's. The pg
    normalisers are upstream's ``_optimizer_step_loss_norm`` over those masks (summed over the DP group, / gas);
    a micro-batch without a pg mask counts its action mask. Every rank makes the same collectives.
    """

    def iter_with_pg_norms(data_iter, strategy, accumulated_gradient, mask_fn):
        dp_group = _get_dp_group(strategy)
        dp_size = dist.get_world_size(group=dp_group) if dist.is_available() and dist.is_initialized() else 1
        gas = max(int(accumulated_gradient), 1)
        window_pg_masks: List[torch.Tensor] = []

        def collecting_mask_fn(item):
            window_pg_masks.append(experience_pg_mask(item))
            return mask_fn(item)

        pg_norm, left = None, 0
        for item, info in upstream_iter(data_iter, strategy, accumulated_gradient, collecting_mask_fn):
            if window_pg_masks:  # first item of a new window
                norm = _optimizer_step_loss_norm(window_pg_masks, dp_group, dp_size, gas)
                pg_norm = {key: norm[key] for key in _NORM_KEYS}
                left = len(window_pg_masks)
                window_pg_masks.clear()
            left -= 1
            setattr(item, PG_NORM_ATTR, pg_norm)
            setattr(item, WINDOW_END_ATTR, left == 0)
            yield item, info

    return iter_with_pg_norms
