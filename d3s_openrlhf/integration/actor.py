"""Worker side of D3S inside OpenRLHF 0.11.x (upstream's ``trainer/ray/ppo_actor.py``): the policy actor, its PPO
trainer and the reference actor.

What runs here (inside each actor Ray worker):

* ``D3SPolicyModelActor``: OpenRLHF's ``PolicyModelActor`` with two additions.
  ``forward(..., return_entropy=True)`` returns ``(action_log_probs, entropy)`` (both (B, A), on CPU) from the
  same single no-grad forward; the entropy is the policy entropy at the action positions only and is zero on
  padding, like the log-probs. It is computed with chunked logits (``experience_forward``) where
  ``training_forward.training_forward_blocker`` allows, otherwise by ``core.entropy_from_logits`` on upstream's
  logits; ``forward(..., chunked_logits=True)`` returns the log-probs alone with chunked logits
  (``--d3s.chunked_logits`` at a step without token selection), computing no entropy.
  ``init_model_from_pretrained`` builds ``D3SActorPPOTrainer``.
* ``D3SReferenceModelActor``: OpenRLHF's ``ReferenceModelActor`` whose forward takes the same chunked-logits path when
  the experience maker asks for it (``chunked_logits=True``).
* ``D3SActorPPOTrainer``: takes ``experience.info["d3s_pg_mask"]`` (the token mask of the experience maker) out of
  each training micro-batch and hands it, with the matching normalisers, to ``D3SPolicyLoss`` for that step; its
  training forward computes the log-probs with chunked logits (``training_forward``) at steps with a pg mask, and
  at every step with ``--d3s.chunked_logits``.

The loss they hand the mask to is ``loss.D3SPolicyLoss`` (with its semantics), the buffer ``replay_buffer``.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
import ray
import torch
from openrlhf.utils.loss_utils import get_loss_batch_info

from d3s_openrlhf.integration.engine_gap import EngineGapMetric
from d3s_openrlhf.integration.experience_forward import ChunkedLogitsForward, EntropyTap
from d3s_openrlhf.integration.host import (
    PG_MASK_KEY,
    chunked_logits_requested,
    config_from_args,
    fixed_updates_batch,
    full_logits_requested,
    loss_needs_every_token,
)
from d3s_openrlhf.integration.lora_sync import MergedLoRASync
from d3s_openrlhf.integration.loss import (
    PG_NORM_ATTR,
    WINDOW_END_ATTR,
    D3SPolicyLoss,
    pg_mask_from_rows,
    with_pg_window_norms,
)
from d3s_openrlhf.integration.replay_buffer import D3SReplayBuffer
from d3s_openrlhf.integration.seams import swapped_globals
from d3s_openrlhf.integration.training_forward import NonFiniteCheck, training_forward, training_forward_blocker

# ---------------------------------------------------------------------------------------------------------------
# the trainer


class D3SActorPPOTrainer(EngineGapMetric, MergedLoRASync, ppo_actor.ActorPPOTrainer):
    """``ActorPPOTrainer`` whose PG surrogate covers only the tokens of ``experience.info["d3s_pg_mask"]``, with the
    merged LoRA weight sync and the engine's gap (``integration.engine_gap``), and with ``--d3s.optimizer_steps
    fixed_updates`` the optimizer steps of a full batch at every rollout step. ``ppo_train`` reports the optimizer
    steps it took (``d3s/optimizer_steps``)."""

    def __init__(self, *args, **kwargs) -> None:
        # upstream builds its loss and replay buffer from these module-level names
        with swapped_globals(ppo_actor, PolicyLoss=D3SPolicyLoss, NaiveReplayBuffer=D3SReplayBuffer):
            super().__init__(*args, **kwargs)
        self._d3s_said = set()  # the forward's one-line reports (``_say_once``)
        self._d3s_window_ends = False  # whether training_step sets DeepSpeed's accumulation boundary itself

    def ppo_train(self, kl_ctl: float):
        steps_before = self.actor_scheduler.last_epoch  # the engine steps the LR scheduler at each optimizer step
        windows = with_pg_window_norms(ppo_actor.iter_grad_accum_global_norm)
        with swapped_globals(ppo_actor, iter_grad_accum_global_norm=windows), self._fixed_updates_windows():
            status = super().ppo_train(kl_ctl)
        status["d3s/optimizer_steps"] = self.actor_scheduler.last_epoch - steps_before
        return status

    @contextmanager
    def _fixed_updates_windows(self) -> Iterator[None]:
        """With ``--d3s.optimizer_steps fixed_updates`` (and no dynamic batching, whose optimizer steps the replay
        buffer plans), the windows of this rollout step: its kept rollouts in U optimizer steps per epoch, so
        gas = local rollouts / (U x micro-batch size). DeepSpeed's gradient accumulation (its 1/gas loss scaling,
        which upstream's normalisers undo) is that for the step, and each micro-batch sets whether it ends its
        window: the engine's own boundary, a count of every micro-step of the run modulo gas, would fall mid-window
        once gas has changed. Upstream's accumulation is restored after the step."""
        kept = len(self.replay_buffer) * self.strategy.world_size
        batch = fixed_updates_batch(self.args, config_from_args(self.args), kept)
        if batch is None or self.args.train.dynamic_batch_enable:
            yield
            return
        engine, micro = self.actor.model, self.args.train.micro_batch_size
        saved_batch, saved_gas = engine.train_batch_size(), self.strategy.accumulated_gradient
        engine.set_train_batch_size(batch)
        self.strategy.accumulated_gradient = batch // (micro * self.strategy.world_size)
        self._d3s_window_ends = True
        try:
            yield
        finally:
            self._d3s_window_ends = False
            engine.set_gradient_accumulation_boundary(None)
            engine.set_train_batch_size(saved_batch)
            self.strategy.accumulated_gradient = saved_gas

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info: Optional[Dict] = None):
        rows = experience.info.pop(PG_MASK_KEY, None)
        window_norm = experience.__dict__.pop(PG_NORM_ATTR, None)
        window_end = experience.__dict__.pop(WINDOW_END_ATTR, None)
        if self._d3s_window_ends:
            self.actor.model.set_gradient_accumulation_boundary(bool(window_end))
        if rows is None:
            if not chunked_logits_requested(self.args):
                return super().training_step(experience, kl_ctl, step, loss_batch_info)
            with self._chunked_logits_forward(experience, None):
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
            with self._chunked_logits_forward(experience, pg_mask):
                return super().training_step(experience, kl_ctl, step, loss_batch_info)

    def _say_once(self, message: str) -> None:
        """Print ``message`` (rank 0) the first time this trainer has it to say."""
        if message not in self._d3s_said:
            self._d3s_said.add(message)
            self.strategy.print(message)

    @contextmanager
    def _chunked_logits_forward(self, experience, pg_mask: Optional[torch.Tensor]) -> Iterator[None]:
        """Within the block the actor's forward computes its log-probs (and entropy) from the final hidden states
        (``training_forward``): at the ``pg_mask`` tokens alone where the loss reads only those, else at every
        action token. Where ``training_forward_blocker`` objects, upstream's forward runs unchanged."""
        blocker = _chunked_logits_blocker(self.strategy, self.actor)
        if blocker is not None:
            self._say_once(f"[d3s] training forward: upstream's, with full logits ({blocker})")
            yield
            return
        reason = loss_needs_every_token(self.args)
        kept_only = pg_mask is not None and reason is None
        where = "the kept tokens only" if kept_only else f"every action token ({reason or 'no token selection'})"
        self._say_once(f"[d3s] training forward with chunked logits: log-probs at {where}")
        non_finite = NonFiniteCheck(prevents="no update made from them leaves the actor")
        # an instance attribute shadows Actor.forward for nn.Module.__call__ (the DeepSpeed engine is inside)
        self.actor.forward = functools.partial(
            training_forward,
            self.actor,
            log_prob_mask=pg_mask if kept_only else None,
            fill_log_probs=experience.action_log_probs if kept_only else None,
            non_finite=non_finite,
        )
        try:
            yield
        finally:
            del self.actor.forward
        # upstream's step ends reading its token count on the host, after its backward and update: refusing a
        # non-finite log-prob here costs no wait, and stops the run before an update made from it leaves the actor
        non_finite.raise_if_any()


# ---------------------------------------------------------------------------------------------------------------
# the Ray actor


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
        chunked_logits: bool = False,
    ):
        """Upstream's forward; with ``return_entropy`` returns ``(action_log_probs, entropy)``, both (B, A) on
        CPU, from the same single forward; with ``return_entropy`` or ``chunked_logits``, with chunked logits where
        ``training_forward_blocker`` allows."""
        upstream = functools.partial(
            super().forward, sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list
        )
        chunked = (return_entropy or chunked_logits) and _chunked_logits_blocker(self.strategy, self.actor) is None
        if not return_entropy and not chunked:
            return upstream()
        if chunked:  # the entropy only where token selection reads it
            tap = ChunkedLogitsForward(self.actor, with_entropy=return_entropy)
        else:
            tap = EntropyTap(self.actor)
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


def _chunked_logits_blocker(strategy, model) -> Optional[str]:
    """Why ``model``'s forwards (training and experience) keep upstream's full logits under ``strategy``, or None."""
    return training_forward_blocker(
        strategy.args, model, full_logits_requested(strategy.args), strategy.ring_attn_group
    )


@ray.remote(num_gpus=1)
class D3SReferenceModelActor(launcher.ReferenceModelActor.__ray_actor_class__):
    """OpenRLHF's reference model actor whose forward, when the experience maker asks (``chunked_logits``: steps with
    token selection, or every step with ``--d3s.chunked_logits``), computes the log-probs with chunked logits as
    the policy actor's forward does."""

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        return_output=False,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
        chunked_logits: bool = False,
    ):
        upstream = functools.partial(
            super().forward,
            sequences,
            action_mask,
            attention_mask,
            return_output,
            packed_seq_lens,
            mm_train_inputs_list,
        )
        if not chunked_logits or return_output or _chunked_logits_blocker(self.strategy, self.model) is not None:
            return upstream()
        with _standing_in(self, "model", ChunkedLogitsForward(self.model)):
            return upstream()
