"""Driver-side D3S / PODS: rollout selection, advantages of the kept rollouts and the token keep mask.

``D3SExperienceMaker`` replaces OpenRLHF's ``RemoteExperienceMaker`` inside the (sync and async) trainers.
Per rollout batch of B prompts x G rollouts (``make_experience_batch``):

1. Rewards: precomputed ones (``--reward.remote_url`` / agent) are used as they are; otherwise the reward
   model alone is run first, on all rollouts.
2. Length penalties (``apply_length_penalties``) are applied once, to the rewards of all rollouts, before the
   selection; upstream's ``compute_advantages_and_returns`` (which would apply them again) is not called on the
   selected rollouts.
3. Selection values: full-group advantages (advantage mode ``group``, D3S) or rewards (mode ``subset``, PODS);
   ``select_rollouts`` keeps a legal count (see ``kept_rollout_count``) with a generator seeded from
   (``seed``, global step).
4. Only the kept rollouts go through ``make_experience`` (actor, reference and critic forwards).
5. Scalar advantages of the kept rollouts: the full-group estimator values (``group``) or the estimator over each
   group's kept members (``subset``); then upstream's per-token steps (``compute_reward`` with the KL term,
   ``get_cumulative_returns``, reinforce_baseline's whitening).
6. With K < 1 at this step the actor's experience-making forward also returns the old policy's per-token
   entropy (no extra forward) and ``token_keep_mask`` over |A_{i,t}| * H_{i,t} of the kept rollouts is stored
   as ``experience.info["d3s_pg_mask"]`` (bool, same shape as ``action_mask``) for the actor's loss.

When no rollout is dropped at a step (sample selection off, or N*B rounding up to all B*G rollouts), the batch
goes through upstream's ``make_experience_batch`` itself (advantages and returns exactly upstream's), plus the
token mask when K < 1; with K = 1 as well, nothing differs from upstream.

Metrics (``last_metrics``, merged into the trainer's step status): the ``d3s/*`` keys of
``d3s_openrlhf.core.metrics.step_metrics`` and ``d3s/select_time_s`` (driver time spent on selection, advantages
and the token mask, forwards excluded).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
from openrlhf.utils.logging_utils import init_logger

from d3s_openrlhf.core.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from d3s_openrlhf.core.batching import intra_counts
from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.core.metrics import step_metrics
from d3s_openrlhf.core.selection import select_rollouts, step_generator
from d3s_openrlhf.core.token_mask import token_keep_mask, token_mask_metrics
from d3s_openrlhf.integration.host import PG_MASK_KEY, config_from_args, kept_count_unit, kept_rollout_count

logger = init_logger(__name__)


def _pad_columns(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.shape[1]))


class D3SExperienceMaker(RemoteExperienceMaker):
    """``RemoteExperienceMaker`` with D3S / PODS down-sampling (see the module docstring).

    The trainer calls ``set_schedule_point(global_step, n, k)`` before every ``make_experience_batch``; after it,
    ``last_metrics`` holds the step's ``d3s/*`` metrics and ``last_rollouts`` all B*G rollouts (None when every
    rollout was trained, i.e. the experiences cover them all).
    """

    def __init__(self, *args, d3s_config: Optional[D3SConfig] = None, **kwargs):
        super().__init__(*args, **kwargs)
        config = d3s_config if d3s_config is not None else config_from_args(self.args)
        if config is None:
            raise ValueError("D3SExperienceMaker needs a D3SConfig (d3s_config=... or args.d3s)")
        self.d3s = config
        self.group_size = self.args.rollout.n_samples_per_prompt
        self.kept_unit = kept_count_unit(self.args, config)
        if config.samples_enabled and self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"sample selection (--d3s.sample_rule {config.sample_rule}) needs a group estimator "
                f"({', '.join(ADVANTAGE_ESTIMATORS)}), got --algo.advantage.estimator {self.advantage_estimator}"
            )
        self.step, self.n, self.k = 0, self.group_size, 1.0
        self.last_metrics: Dict[str, float] = {}
        self.last_rollouts: Optional[List[Experience]] = None
        self._entropy_wanted = False
        self._pair_refs = None  # the actor forward's refs to (log_probs, entropy) pairs, until flattened
        self._entropies = None
        self._select_time = 0.0

    def set_schedule_point(self, step: int, n: int, k: float) -> None:
        """(N, K) of the coming batch and its global step (which seeds the tie-breaking generator)."""
        self.step, self.n, self.k = int(step), int(n), float(k)

    # ── the batch ──

    @torch.no_grad()
    def make_experience_batch(self, rollout_samples) -> List[Experience]:
        self.last_metrics = {}
        self.last_rollouts = None
        self._select_time = 0.0
        if not self.d3s.enabled:
            return super().make_experience_batch(rollout_samples)

        total = len(rollout_samples)
        if total % self.group_size:
            raise ValueError(f"{total} rollouts do not form whole groups of {self.group_size}")
        num_prompts = total // self.group_size
        kept = (
            kept_rollout_count(self.n, num_prompts, self.group_size, self.kept_unit)
            if self.d3s.samples_enabled
            else total
        )
        all_tokens = sum(int(sample.action_mask.sum()) for sample in rollout_samples)
        token_level = self.k < 1.0

        if kept == total:
            if rollout_samples[0].rewards is not None:  # precomputed: refuse bad ones before any forward
                self._check_rewards(torch.cat([sample.rewards for sample in rollout_samples]))
            experiences, entropies = self._forward(super().make_experience_batch, rollout_samples, token_level)
            t0 = time.perf_counter()
            rewards = self._reward_grid(experiences)
            self._check_rewards(rewards.reshape(-1))
            advantages = kept_advantages = self._scalar_advantages(rewards)
        else:
            experiences, entropies, rewards, advantages, kept_advantages = self._make_selected(
                rollout_samples, num_prompts, kept, token_level
            )
            self.last_rollouts = rollout_samples
            t0 = time.perf_counter()

        # the response tokens of the kept rollouts: what K is applied to
        candidate_tokens = sum(int(e.action_mask.sum()) for e in experiences)
        token_stats = self._attach_token_mask(experiences, entropies) if token_level else None
        metrics = step_metrics(
            self.n,
            self.k,
            rewards,
            kept,
            candidate_tokens,
            all_tokens,
            advantages=advantages,
            kept_advantages=kept_advantages,
            token_stats=token_stats,
        )
        metrics["d3s/select_time_s"] = self._select_time + time.perf_counter() - t0
        self.last_metrics = metrics
        return experiences

    def _make_selected(self, rollout_samples, num_prompts: int, kept: int, token_level: bool):
        """Rewards, selection, forwards of the kept rollouts, their returns; times the non-forward parts.

        Returns (experiences, entropies or None, rewards (B, G), full-group scalar advantages (B*G,), scalar
        advantages of the kept rollouts as trained).
        """
        args = self.args
        if rollout_samples[0].rewards is None:
            self._reward_model_forward(rollout_samples)

        t0 = time.perf_counter()
        for sample in rollout_samples:
            sample.rewards = sample.rewards.to(torch.promote_types(sample.rewards.dtype, torch.float32))
        self._check_rewards(torch.cat([sample.rewards for sample in rollout_samples]))
        apply_length_penalties(rollout_samples, args)
        rewards = torch.cat([sample.rewards for sample in rollout_samples]).reshape(num_prompts, self.group_size)

        full = group_advantages(rewards, self.advantage_estimator)
        values = full if self.d3s.advantage_mode == "group" else rewards
        kept_index = self._select(values, kept, step_generator(self.d3s.seed, self.step))
        if self.d3s.advantage_mode == "group":
            scalars = full.reshape(-1)
        else:
            kept_mask = torch.zeros(rewards.numel(), dtype=torch.bool)
            kept_mask[kept_index] = True
            scalars = group_advantages(rewards, self.advantage_estimator, kept=kept_mask.view_as(rewards)).reshape(-1)
        self._select_time = time.perf_counter() - t0

        kept_samples = [rollout_samples[i] for i in kept_index.tolist()]
        experiences, entropies = self._forward(
            lambda samples: self.make_experience(self.split_rollout_samples(samples)), kept_samples, token_level
        )

        t0 = time.perf_counter()
        self._shape_returns(experiences, scalars, kept_index, rewards)
        self._select_time += time.perf_counter() - t0
        return experiences, entropies, rewards, full.reshape(-1), scalars[kept_index]

    def _check_rewards(self, rewards: torch.Tensor) -> None:
        """Raise if any reward (B*G,) is NaN or infinite: selection, advantages and the loss would all be NaN."""
        bad = ~torch.isfinite(rewards)
        if not bool(bad.any()):
            return
        args = self.args
        if args.train.agent_func_path:
            source = f"the agent --train.agent_func_path {args.train.agent_func_path}"
        elif args.reward.remote_url:
            source = f"the reward function --reward.remote_url {args.reward.remote_url}"
        else:
            source = f"the reward model --reward.model_name_or_path {args.reward.model_name_or_path}"
        where = bad.nonzero().squeeze(1)
        shown = ", ".join(f"{i} (prompt {i // self.group_size})" for i in where[:8].tolist())
        more = f" and {where.numel() - 8} more" if where.numel() > 8 else ""
        raise ValueError(
            f"{where.numel()} of {rewards.numel()} rewards at step {self.step} are NaN or infinite, from {source}: "
            f"rollouts {shown}{more} (values {rewards[where[:8]].tolist()}). D3S stops before any update; make the "
            "reward finite (e.g. return 0 for a response that cannot be scored)"
        )

    def _select(self, values: torch.Tensor, kept: int, generator: torch.Generator) -> torch.Tensor:
        """Sorted flat indices of the ``kept`` rollouts (intra: N or N+1 per prompt, extras drawn at random)."""
        rule = self.d3s.sample_rule
        if self.d3s.sample_scope == "cross":
            return select_rollouts(values, kept, scope="cross", rule=rule, generator=generator)
        num_prompts, group_size = values.shape
        counts = intra_counts(kept, kept // num_prompts, num_prompts, generator=generator)
        chosen = []
        for count in torch.unique(counts).tolist():
            rows = (counts == count).nonzero().squeeze(1)
            local = select_rollouts(values[rows], count, scope="intra", rule=rule, generator=generator)
            chosen.append(rows[local // group_size] * group_size + local % group_size)
        return torch.cat(chosen).sort().values

    # ── forwards ──

    def _forward(self, make, samples, token_level: bool):
        """Run ``make(samples)`` with the actor forward returning entropy when ``token_level``; (exps, entropy)."""
        self._entropy_wanted = token_level
        self._pair_refs = self._entropies = None
        try:
            experiences = make(samples)
        finally:
            self._entropy_wanted = False
            self._pair_refs = None
        if not token_level:
            return experiences, None
        entropies, self._entropies = self._entropies, None
        if entropies is None:
            raise RuntimeError("token selection needs the actor forward, which did not run")
        return experiences, entropies

    def _dispatch_forward(self, group, sync_condition, **kwargs):
        """Upstream's dispatch; when token selection runs, the actor's forward is asked for (log_probs, entropy) and
        the reference's for its log-probs with chunked logits (both through ``experience_forward``); otherwise, with
        ``--d3s.chunked_logits``, both for their log-probs with chunked logits.

        The refs to those pairs go to upstream's ``make_experience`` unchanged; ``_flatten_results`` recognises
        them and splits the pairs in this process (no extra Ray work).
        """
        model_groups = (self.actor_model_group, self.initial_model_group)
        if group not in model_groups or not (self._entropy_wanted or self.d3s.chunked_logits):
            return super()._dispatch_forward(group, sync_condition, **kwargs)
        batches = len(next(iter(kwargs.values())))
        if group is self.initial_model_group or not self._entropy_wanted:
            # log-probs with chunked logits (D3SReferenceModelActor, D3SPolicyModelActor)
            return super()._dispatch_forward(group, sync_condition, chunked_logits=[True] * batches, **kwargs)
        self._pair_refs = super()._dispatch_forward(group, sync_condition, return_entropy=[True] * batches, **kwargs)
        return self._pair_refs

    def _flatten_results(self, refs, duplicate_factor):
        """Upstream's gather; for the actor's (log_probs, entropy) refs it keeps the entropies and returns the
        log-probs. Ring-attention / tensor-parallel duplicates are dropped before anything is fetched."""
        if refs is not self._pair_refs:
            return super()._flatten_results(refs, duplicate_factor)
        self._pair_refs = None
        pairs = super()._flatten_results(refs[::duplicate_factor], 1)
        self._entropies = [entropy for _, entropy in pairs]
        return [log_probs for log_probs, _ in pairs]

    def _reward_model_forward(self, rollout_samples) -> None:
        """Rewards of all rollouts from the reward model alone (before any other forward), put on the samples."""
        if self.reward_model_group is None:
            raise ValueError("reward_model_group is required when rewards are not precomputed")
        args = self.args
        batches = self.split_rollout_samples(rollout_samples)
        refs = self._dispatch_forward(
            self.reward_model_group,
            args.train.colocate_all or args.train.colocate_critic_reward,
            sequences=[batch.sequences for batch in batches],
            attention_mask=[batch.attention_mask for batch in batches],
            pad_sequence=[True] * len(batches),
        )
        duplicate_factor = args.ds.ring_attn_size * args.ds.tensor_parallel_size
        for batch, batch_rewards in zip(batches, self._flatten_results(refs, duplicate_factor)):
            for row, position in enumerate(batch.index):
                rollout_samples[position].rewards = batch_rewards[row : row + 1]
                rollout_samples[position].info["reward"] = batch_rewards[row : row + 1]

    # ── advantages and returns of the kept rollouts ──

    def _shape_returns(self, experiences, scalars: torch.Tensor, kept_index: torch.Tensor, rewards) -> None:
        """Upstream's per-token part of ``compute_advantages_and_returns`` on given scalar advantages."""
        args = self.args
        group_size = self.group_size
        group_std = rewards.std(-1) if group_size > 1 else None
        if args.algo.advantage.gamma != 1.0:
            logger.warning(f"gamma is set to 1.0 for {self.advantage_estimator}")
            args.algo.advantage.gamma = 1.0
        for experience in experiences:
            flat = kept_index[torch.tensor(experience.index, dtype=torch.long)]
            if group_std is not None:
                experience.info["group_reward_std"] = group_std[flat // group_size]
            reward = compute_reward(
                scalars[flat],
                self.kl_ctl.value,
                experience.kl,
                action_mask=experience.action_mask,
                reward_clip_range=args.reward.clip_range,
            )
            experience.returns = self.get_cumulative_returns(reward, experience.action_mask, args.algo.advantage.gamma)
            experience.advantages = experience.returns.clone()
            experience.info["return"] = reward.sum(dim=-1)
            experience.kl = None
        if self.advantage_estimator == "reinforce_baseline":
            self._whiten(experiences)

    def _whiten(self, experiences) -> None:
        """reinforce_baseline's whitening over all action tokens of the batch (upstream's formula)."""
        advantages = torch.cat([e.advantages.flatten() for e in experiences]).float()
        masks = torch.cat([e.action_mask.flatten() for e in experiences])
        count = masks.sum()
        mean = (advantages * masks).sum() / count
        if self.args.algo.advantage.no_std_norm:
            rstd = 1
        else:
            rstd = (((advantages - mean).pow(2) * masks).sum() / count).clamp(min=1e-8).rsqrt()
        for experience in experiences:
            experience.advantages = (experience.advantages - mean) * rstd

    def _reward_grid(self, experiences) -> torch.Tensor:
        """(B, G) rewards (after penalties) in rollout order, from experiences covering every rollout."""
        index = torch.tensor([i for e in experiences for i in e.index], dtype=torch.long)
        flat = torch.cat([e.rewards for e in experiences])
        grid = torch.empty_like(flat)
        grid[index] = flat
        return grid.reshape(-1, self.group_size)

    def _scalar_advantages(self, rewards: torch.Tensor) -> Optional[torch.Tensor]:
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            return None
        return group_advantages(rewards, self.advantage_estimator).reshape(-1)

    # ── tokens ──

    def _attach_token_mask(self, experiences, entropies: Sequence[torch.Tensor]) -> Dict[str, float]:
        """``token_keep_mask`` over all kept rollouts at once; each experience gets its rows in ``info``."""
        for experience, entropy in zip(experiences, entropies):
            if entropy.shape != experience.action_mask.shape:
                raise ValueError(
                    f"actor entropy has shape {tuple(entropy.shape)}, action_mask {tuple(experience.action_mask.shape)}"
                )
        width = max(e.action_mask.shape[1] for e in experiences)
        advantages = torch.cat([_pad_columns(e.advantages, width) for e in experiences])
        entropy = torch.cat([_pad_columns(h.float(), width) for h in entropies])
        action_mask = torch.cat([_pad_columns(e.action_mask.bool(), width) for e in experiences])
        mask = token_keep_mask(advantages, entropy, action_mask, self.k, scope=self.d3s.token_scope)
        start = 0
        for experience in experiences:
            rows, columns = experience.action_mask.shape
            experience.info[PG_MASK_KEY] = mask[start : start + rows, :columns].clone()
            start += rows
        return token_mask_metrics(mask, action_mask, entropy, advantages)
