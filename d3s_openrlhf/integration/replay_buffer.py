"""The replay buffer of the D3S actor trainer: upstream's ``NaiveReplayBuffer``
(``openrlhf/trainer/ppo_utils/replay_buffer.py``) that also counts the kept tokens of each dynamic optimizer step, and
with ``--d3s.optimizer_steps fixed_updates`` plans the U optimizer steps of a full batch."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

import torch
import torch.distributed as dist
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer

from d3s_openrlhf.integration.host import config_from_args, fixed_updates_batch
from d3s_openrlhf.integration.loss import experience_pg_mask


class D3SReplayBuffer(NaiveReplayBuffer):
    """Replay buffer that, with dynamic batching, also counts the kept tokens and kept sequences of every dynamic
    optimizer step (over the DP group), next to upstream's full counts; with fixed updates, its optimizer steps are
    the U of a full batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.d3s_pg_batch_num_tokens: List[float] = []
        self.d3s_pg_global_batch_size: List[float] = []

    def setup_dynamic_batch(self, strategy):
        dp_size = dist.get_world_size(group=strategy.ds_device_mesh["dp"].get_group())
        with _optimizer_batch(strategy.args, len(self.items) * dp_size):
            super().setup_dynamic_batch(strategy)
        # group upstream's micro-batches into its optimizer steps (the last micro-batch of a step is flagged 1)
        # every item's kept tokens with one read (the items may be on the GPU: no host sync per sample)
        kept_tokens = (
            torch.stack([experience_pg_mask(item).sum() for item in self.items]).tolist() if self.items else []
        )
        counts, micro_batches_per_step, tokens, seqs, n_micro = [], [], 0, 0, 0
        for indices, is_last in zip(self.dynamic_indices, self.dynamic_optimizer_step):
            for idx in indices:
                kept = kept_tokens[idx]
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


@contextmanager
def _optimizer_batch(args, kept: int) -> Iterator[None]:
    """Upstream plans the dynamic optimizer steps of a rollout step over its buffer in batches of
    ``--train.batch_size`` (at most B x G / that many): with fixed updates, the step's kept / U instead, for U steps."""
    batch = fixed_updates_batch(args, config_from_args(args), kept)
    if batch is None:
        yield
        return
    saved = args.train.batch_size
    args.train.batch_size = batch
    try:
        yield
    finally:
        args.train.batch_size = saved
