"""Worker side of D3S inside OpenRLHF 0.11.x: the policy actor, its PPO trainer and the token-level PG loss.

What runs here (inside each actor Ray worker):

* ``D3SPolicyModelActor``: OpenRLHF's ``PolicyModelActor`` with two additions.
  ``forward(..., return_entropy=True)`` returns ``(action_log_probs, entropy)`` (both (B, A), on CPU) from the
  same single no-grad forward; the entropy is the policy entropy at the action positions only and is zero on
  padding, like the log-probs. It is computed without full logits (``experience_forward``) where
  ``training_forward.training_forward_blocker`` allows, otherwise by ``core.entropy_from_logits`` on upstream's
  logits; ``forward(..., head_free=True)`` returns the log-probs alone without full logits (``--d3s.chunked_logits``
  at a step without token selection), computing no entropy. ``init_model_from_pretrained`` builds
  ``D3SActorPPOTrainer``.
* ``D3SReferenceModelActor``: OpenRLHF's ``ReferenceModelActor`` whose forward takes the same head-free path when
  the experience maker asks for it (``head_free=True``).
* ``D3SActorPPOTrainer``: takes ``experience.info["d3s_pg_mask"]`` (the token mask of the experience maker) out of
  each training micro-batch and hands it, with the matching normalisers, to ``D3SPolicyLoss`` for that step; its
  training forward computes the log-probs without full logits (``training_forward``) at steps with a pg mask, and
  at every step with ``--d3s.chunked_logits``.
* ``D3SPolicyLoss``: upstream's ``PolicyLoss`` restricted to the kept tokens.

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

import functools
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Union

import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
import ray
import torch
import torch.distributed as dist
from openrlhf.models import PolicyLoss
from openrlhf.models.ring_attn_utils import gather_and_pad_tensor
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
from openrlhf.utils.loss_utils import (
    _get_dp_group,
    _optimizer_step_loss_norm,
    get_loss_batch_info,
)

from d3s_openrlhf.core.entropy import entropy_from_logits
from d3s_openrlhf.integration.experience_forward import HeadFreeForward
from d3s_openrlhf.integration.host import (
    PG_MASK_KEY,
    chunked_logits_requested,
    full_logits_requested,
    loss_needs_every_token,
)
from d3s_openrlhf.integration.lora_sync import MergedLoRASync
from d3s_openrlhf.integration.seams import swapped_globals
from d3s_openrlhf.integration.training_forward import training_forward, training_forward_blocker

_PG_NORM_ATTR = "d3s_pg_loss_norm"
"""Attribute that the window iterator sets on each training micro-batch: its window's kept-token normalisers."""

_NORM_KEYS = ("batch_num_tokens", "global_batch_size")


# ---------------------------------------------------------------------------------------------------------------
# pg masks


def pg_mask_from_rows(rows: Union[Sequence[torch.Tensor], torch.Tensor], action_mask: torch.Tensor) -> torch.Tensor:
    """Rebuild the (B, A) pg mask of a (re-padded) micro-batch from its per-sample rows.

    Each row is aligned with its sample's action-mask row from the left (OpenRLHF right-pads responses and trims
    only trailing padding), but may be wider or narrower than ``action_mask``'s width A: it is cut or padded with
    False to A. The result is ANDed with ``action_mask``.
    """
    if len(rows) != action_mask.shape[0]:
        raise ValueError(f"{len(rows)} pg-mask rows for a micro-batch of {action_mask.shape[0]} samples")
    width = action_mask.shape[1]
    mask = torch.zeros(action_mask.shape, dtype=torch.bool, device=action_mask.device)
    for i, row in enumerate(rows):
        row = row.reshape(-1)
        if row.shape[0] > width and bool(row[width:].any()):
            raise ValueError(
                f"pg-mask row {i} keeps tokens beyond the response width {width}: it is not aligned with action_mask"
            )
        n = min(width, row.shape[0])
        mask[i, :n] = row[:n].to(device=mask.device, dtype=torch.bool)
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
    normalisers (attribute ``d3s_pg_loss_norm``: ``{"batch_num_tokens", "global_batch_size"}``).

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

        pg_norm = None
        for item, info in upstream_iter(data_iter, strategy, accumulated_gradient, collecting_mask_fn):
            if window_pg_masks:  # first item of a new window
                norm = _optimizer_step_loss_norm(window_pg_masks, dp_group, dp_size, gas)
                pg_norm = {key: norm[key] for key in _NORM_KEYS}
                window_pg_masks.clear()
            setattr(item, _PG_NORM_ATTR, pg_norm)
            yield item, info

    return iter_with_pg_norms


class D3SReplayBuffer(NaiveReplayBuffer):
    """Replay buffer that, with dynamic batching, also counts the kept tokens and kept sequences of every dynamic
    optimizer step (over the DP group), next to upstream's full counts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.d3s_pg_batch_num_tokens: List[float] = []
        self.d3s_pg_global_batch_size: List[float] = []

    def setup_dynamic_batch(self, strategy):
        super().setup_dynamic_batch(strategy)
        # group upstream's micro-batches into its optimizer steps (the last micro-batch of a step is flagged 1)
        counts, micro_batches_per_step, tokens, seqs, n_micro = [], [], 0, 0, 0
        for indices, is_last in zip(self.dynamic_indices, self.dynamic_optimizer_step):
            for idx in indices:
                item = self.items[idx]
                kept = experience_pg_mask(item).sum().item()
                tokens += kept
                seqs += int(kept > 0)
            n_micro += 1
            if is_last:
                counts.append([tokens, seqs])
                micro_batches_per_step.append(n_micro)
                tokens, seqs, n_micro = 0, 0, 0
        self.d3s_pg_batch_num_tokens, self.d3s_pg_global_batch_size = [], []
        if not counts:
            return
        totals = torch.tensor(counts, dtype=torch.float, device=torch.cuda.current_device())
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=strategy.ds_device_mesh["dp"].get_group())
        for (step_tokens, step_seqs), n in zip(totals.tolist(), micro_batches_per_step):
            self.d3s_pg_batch_num_tokens.extend([step_tokens] * n)
            self.d3s_pg_global_batch_size.extend([step_seqs] * n)


# ---------------------------------------------------------------------------------------------------------------
# the trainer


class D3SActorPPOTrainer(MergedLoRASync, ppo_actor.ActorPPOTrainer):
    """``ActorPPOTrainer`` whose PG surrogate covers only the tokens of ``experience.info["d3s_pg_mask"]``, with the
    merged LoRA weight sync."""

    def __init__(self, *args, **kwargs) -> None:
        # upstream builds its loss and replay buffer from these module-level names
        with swapped_globals(ppo_actor, PolicyLoss=D3SPolicyLoss, NaiveReplayBuffer=D3SReplayBuffer):
            super().__init__(*args, **kwargs)
        self._d3s_said = set()  # the forward's one-line reports (``_say_once``)

    def ppo_train(self, kl_ctl: float):
        windows = with_pg_window_norms(ppo_actor.iter_grad_accum_global_norm)
        with swapped_globals(ppo_actor, iter_grad_accum_global_norm=windows):
            return super().ppo_train(kl_ctl)

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info: Optional[Dict] = None):
        rows = experience.info.pop(PG_MASK_KEY, None)
        window_norm = experience.__dict__.pop(_PG_NORM_ATTR, None)
        if rows is None:
            if not chunked_logits_requested(self.args):
                return super().training_step(experience, kl_ctl, step, loss_batch_info)
            with self._forward_without_full_logits(experience, None):
                return super().training_step(experience, kl_ctl, step, loss_batch_info)

        pg_mask = pg_mask_from_rows(rows, experience.action_mask)
        if self.args.train.dynamic_batch_enable:
            pg_norm = get_loss_batch_info(
                self.strategy,
                pg_mask,
                batch_num_tokens=self.replay_buffer.d3s_pg_batch_num_tokens[step],
                global_batch_size=self.replay_buffer.d3s_pg_global_batch_size[step],
            )
        elif window_norm is not None:
            pg_norm = window_norm
        elif loss_batch_info is None:
            # upstream then normalises over this micro-batch (all-reduced over DP); do the same over kept tokens
            pg_norm = get_loss_batch_info(self.strategy, pg_mask)
        else:
            raise ValueError(
                "training_step got loss normalisers without the matching kept-token normalisers: call it through "
                "ppo_train, or with loss_batch_info=None"
            )
        with self.actor_loss_fn.selecting(pg_mask, pg_norm["batch_num_tokens"], pg_norm["global_batch_size"]):
            with self._forward_without_full_logits(experience, pg_mask):
                return super().training_step(experience, kl_ctl, step, loss_batch_info)

    def _say_once(self, message: str) -> None:
        """Print ``message`` (rank 0) the first time this trainer has it to say."""
        if message not in self._d3s_said:
            self._d3s_said.add(message)
            self.strategy.print(message)

    @contextmanager
    def _forward_without_full_logits(self, experience, pg_mask: Optional[torch.Tensor]) -> Iterator[None]:
        """Within the block the actor's forward computes its log-probs (and entropy) from the final hidden states
        (``training_forward``): at the ``pg_mask`` tokens alone where the loss reads only those, else at every
        action token. Where ``training_forward_blocker`` objects, upstream's forward runs unchanged."""
        blocker = _head_free_blocker(self.strategy, self.actor)
        if blocker is not None:
            self._say_once(f"[d3s] training forward: upstream's, with full logits ({blocker})")
            yield
            return
        reason = loss_needs_every_token(self.args)
        kept_only = pg_mask is not None and reason is None
        where = "the kept tokens only" if kept_only else f"every action token ({reason or 'no token selection'})"
        self._say_once(f"[d3s] training forward without full logits: log-probs at {where}")
        # an instance attribute shadows Actor.forward for nn.Module.__call__ (the DeepSpeed engine is inside)
        self.actor.forward = functools.partial(
            training_forward,
            self.actor,
            log_prob_mask=pg_mask if kept_only else None,
            fill_log_probs=experience.action_log_probs if kept_only else None,
        )
        try:
            yield
        finally:
            del self.actor.forward


# ---------------------------------------------------------------------------------------------------------------
# the Ray actor


class _EntropyTap:
    """Stands in for the actor model during one experience-making forward: calls it with return_output=True,
    keeps the per-token entropy of the action positions and returns the log-probs as the plain call would."""

    def __init__(self, model) -> None:
        self.model = model
        self.entropy: Optional[torch.Tensor] = None

    def __getattr__(self, name):  # eval(), train(), is_vlm, ... of the wrapped actor
        return getattr(self.model, name)

    def __call__(self, sequences, action_mask, attention_mask, **kwargs):
        action_log_probs, output = self.model(sequences, action_mask, attention_mask, return_output=True, **kwargs)
        logits = output["logits"]  # fp32, temperature-scaled: the policy the log-probs describe
        width = action_mask.shape[1]
        if getattr(self.model, "packing_samples", False):
            # packed (1, local tokens, V): entropy of every local position, gathered and re-padded to (B, S) the
            # way OpenRLHF's Actor re-pads its own entropy and log-probs
            ring_group = kwargs.get("ring_attn_group")
            indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
            pad_len = 0
            if ring_group is not None:
                ring_size = dist.get_world_size(group=ring_group)
                pad_len = (ring_size - indices.numel() % ring_size) % ring_size
            entropy = gather_and_pad_tensor(
                entropy_from_logits(logits), ring_group, pad_len, indices, *sequences.shape
            )
            entropy = entropy[:, :-1][:, -width:]
        else:
            # position t predicts token t + 1 (as in Actor.forward): logits[:, :-1], then the last A positions
            entropy = entropy_from_logits(logits[:, :-1][:, -width:])
        self.entropy = entropy * action_mask.to(entropy.dtype)
        return action_log_probs


@ray.remote(num_gpus=1)
class D3SPolicyModelActor(ppo_actor.PolicyModelActor.__ray_actor_class__):
    """OpenRLHF's policy actor with the D3S trainer and the entropy forward. Its LR-scheduler horizon
    ``max_steps`` already counts the kept rollouts only (the D3S trainers' ``get_max_steps``)."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        upstream = super().init_model_from_pretrained
        with swapped_globals(upstream.__func__, ActorPPOTrainer=D3SActorPPOTrainer):
            upstream(strategy, pretrain, max_steps, vllm_engines)

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
        return_entropy: bool = False,
        head_free: bool = False,
    ):
        """Upstream's forward; with ``return_entropy`` returns ``(action_log_probs, entropy)``, both (B, A) on
        CPU, from the same single forward; with ``return_entropy`` or ``head_free``, without full logits where
        ``training_forward_blocker`` allows."""
        upstream = functools.partial(
            super().forward, sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list
        )
        without_logits = (return_entropy or head_free) and _head_free_blocker(self.strategy, self.actor) is None
        if not return_entropy and not without_logits:
            return upstream()
        if without_logits:  # the entropy only where token selection reads it
            tap = HeadFreeForward(self.actor, with_entropy=return_entropy)
        else:
            tap = _EntropyTap(self.actor)
        with _standing_in(self, "actor", tap):
            action_log_probs = upstream()
        return (action_log_probs, tap.entropy.to("cpu")) if return_entropy else action_log_probs


@contextmanager
def _standing_in(worker, name: str, tap):
    """Within the block ``worker.<name>`` is ``tap``, a stand-in that wraps the original model as ``tap.model``."""
    setattr(worker, name, tap)
    try:
        yield tap
    finally:
        setattr(worker, name, tap.model)


def _head_free_blocker(strategy, model) -> Optional[str]:
    """Why ``model``'s forwards (training and experience) keep upstream's full logits under ``strategy``, or None."""
    return training_forward_blocker(
        strategy.args, model, full_logits_requested(strategy.args), strategy.ring_attn_group
    )


@ray.remote(num_gpus=1)
class D3SReferenceModelActor(launcher.ReferenceModelActor.__ray_actor_class__):
    """OpenRLHF's reference model actor whose forward, when the experience maker asks (``head_free``: steps with
    token selection, or every step with ``--d3s.chunked_logits``), computes the log-probs without full logits as
    the policy actor's forward does."""

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        return_output=False,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
        head_free: bool = False,
    ):
        upstream = functools.partial(
            super().forward, sequences, action_mask, attention_mask, return_output, packed_seq_lens, mm_train_inputs_list
        )
        if not head_free or return_output or _head_free_blocker(self.strategy, self.model) is not None:
            return upstream()
        with _standing_in(self, "model", HeadFreeForward(self.model)):
            return upstream()
