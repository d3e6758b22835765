"""Prompt skipping before generation (``--d3s.prompt_skip history``) inside OpenRLHF's ``SamplesGenerator``.

``D3SSamplesGenerator`` replaces upstream's generator in the sync trainer and in the async generator actor. Its
training batches (``_generate_vllm`` on the prompt dataloader's iterator; evaluation is untouched) draw prompts
through :class:`SkippingPrompts`, which asks the policy (``core.prompt_skip``) about each prompt and hands
upstream the next prompt it keeps: upstream's own loop then fills the batch to B prompts, and its dynamic-filtering
replacements are drawn the same way. Every generated group, a filtered one too, is reported to the policy as its
responses are turned into experiences, and the skip probability adapts once per batch.

Accounting: a skipped prompt is consumed from the dataloader (the epoch ends sooner) and counted in the batch's
``prompts_consumed`` once, as a filtered prompt is; a generated prompt is counted by upstream. When the epoch's
prompts run out mid-batch, the epoch's skipped prompts fill the batch (``d3s/refilled_prompts``), so skipping never
leaves a short last batch that upstream would not train (it takes no step on fewer rollouts than
``--train.batch_size``). Prompts that :class:`SkippingPrompts` has read from the dataloader but not yet handed on
(the rest of a dataloader batch) are kept, not dropped, and travel with the checkpoint.

Checkpoints: the policy's state rides in the prompt dataloader's state dict (key ``d3s_prompt_skip``), which both
trainers already save with every checkpoint and restore on resume (``DataloaderWithSkipState``), so a resumed run
skips as the uninterrupted one would. The same entry carries the batch's metrics to the trainer that logs them, in
the sync and the async mode alike: ``d3s/skipped_prompts``, ``d3s/refilled_prompts``, ``d3s/skip_prob`` (the
probability the batch was drawn with), ``d3s/skip_candidates`` and ``d3s/generated_tokens`` (response tokens
generated, filtered groups included). A draw that yields no sample (the rest of an epoch all skipped or filtered)
trains no step; its counts are added to the next step's, so only the skips after the run's last step go unlogged.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from d3s_openrlhf.core.selection import step_generator
from d3s_openrlhf.integration.host import config_from_args

STATE_KEY = "d3s_prompt_skip"
"""Key of the skip policy's state (and the last batch's metrics) in the prompt dataloader's state dict."""


def prompt_key(prompt: str, label) -> str:
    """A prompt's identity across epochs and shuffles: a digest of its text and label."""
    return hashlib.blake2b(f"{prompt}\0{label}".encode(), digest_size=8).hexdigest()


class SkippingPrompts:
    """The prompt dataloader's iterator, one prompt per item (upstream's batch tuple of size 1), without the prompts
    the policy skips. ``pending`` holds the rest of the dataloader batch last read and ``skipped_items`` the epoch's
    skipped prompts (which fill a batch the epoch's end would leave short), as (datasource, prompt, label, image)
    tuples."""

    def __init__(self, source, policy, pending: Optional[List[Tuple]] = None, skipped: Optional[List[Tuple]] = None):
        self.source = source
        self.policy = policy
        self.pending: List[Tuple] = list(pending or [])
        self.generator = None  # the draws of the batch being drawn (``start_batch``)
        self.skipped_items: List[Tuple] = list(skipped or [])  # the epoch's skipped prompts, in order
        self.yielded = self.skipped = self.refilled = self.candidates = 0  # of the batch being drawn

    def start_batch(self, generator) -> None:
        self.generator = generator
        self.yielded = self.skipped = self.refilled = self.candidates = 0

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if not self.pending:
                try:
                    self.pending = list(zip(*next(self.source)))
                except StopIteration:
                    # the epoch ran out mid-batch: its skipped prompts fill the batch before it ends short
                    # (upstream trains no step on fewer rollouts than --train.batch_size: they would be lost)
                    if not (self.yielded and self.skipped_items):
                        raise
                    self.refilled += 1
                    return self._as_batch(self.skipped_items.pop())
            item = self.pending.pop(0)
            key = prompt_key(item[1], item[2])
            self.candidates += self.policy.is_candidate(key)
            if self.policy.skips([key], self.generator)[0]:
                self.skipped += 1
                self.skipped_items.append(item)
                continue
            return self._as_batch(item)

    def _as_batch(self, item):
        self.yielded += 1
        datasource, prompt, label, image = item
        return [datasource], [prompt], [label], [image]


class DataloaderWithSkipState:
    """The prompt dataloader, whose state dict also holds the skip policy's state (and the last batch's metrics)."""

    def __init__(self, dataloader, owner: "D3SSamplesGenerator"):
        self.dataloader = dataloader
        self.owner = owner

    def __iter__(self):
        return iter(self.dataloader)

    def __len__(self):
        return len(self.dataloader)

    def __getattr__(self, name):
        return getattr(self.dataloader, name)

    def state_dict(self):
        return {**self.dataloader.state_dict(), STATE_KEY: self.owner.skip_state()}

    def load_state_dict(self, state):
        state = dict(state)
        skip = state.pop(STATE_KEY, None)
        self.dataloader.load_state_dict(state)
        if skip is not None:
            self.owner.load_skip_state(skip)


class D3SSamplesGenerator(SamplesGenerator):
    """``SamplesGenerator`` that skips prompts before generation (see the module docstring); upstream's, unchanged,
    with ``--d3s.prompt_skip off``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.d3s = config_from_args(self.args)
        self.policy = self.d3s.skip_policy()
        if self.d3s.skip_enabled:
            self.prompts_dataloader = DataloaderWithSkipState(self.prompts_dataloader, self)
        self.batches = 0  # training batches drawn: with the seed, the key of each batch's random draws
        self._skipping: Optional[SkippingPrompts] = None
        self._restored: Tuple[List, List] = ([], [])  # (pending, skipped) prompts of a checkpoint
        self._groups: Optional[Dict[str, List[float]]] = None  # the rewards of each group, while a batch is drawn
        self._generated_tokens = 0
        self._unlogged: Dict[str, float] = {}
        self.last_metrics: Dict[str, float] = {}

    # ── the training batch ──

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):
        training = dataloader_iter is getattr(self, "_dataloader_iter", None)  # not the evaluation's
        if not (self.d3s.skip_enabled and training):
            return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        if self._skipping is None or self._skipping.source is not dataloader_iter:  # a new epoch's iterator
            self._skipping = SkippingPrompts(dataloader_iter, self.policy, *self._restored)
            self._restored = ([], [])
        self._skipping.start_batch(step_generator(self.d3s.seed, self.batches))
        self._groups, self._generated_tokens = defaultdict(list), 0
        prob = self.policy.prob
        try:
            experiences, consumed, exhausted = super()._generate_vllm(
                self._skipping, num_prompts, dynamic_filtering, **generate_kwargs
            )
        finally:
            self.batches += 1
            groups, self._groups = self._groups, None
        zero_variance = [self.policy.observe(key, rewards) for key, rewards in sorted(groups.items())]
        if zero_variance:
            self.policy.adapt(sum(zero_variance) / len(zero_variance))
        counts = {
            "d3s/skipped_prompts": float(self._skipping.skipped),
            "d3s/refilled_prompts": float(self._skipping.refilled),
            "d3s/skip_candidates": float(self._skipping.candidates),
            "d3s/generated_tokens": float(self._generated_tokens),
        }
        # a batch without samples (the epoch's last prompts all skipped or filtered) trains no step and logs
        # nothing: its counts go to the next batch that does
        for key, value in self._unlogged.items():
            counts[key] += value
        self._unlogged = {} if experiences else counts
        self.last_metrics = {**counts, "d3s/skip_prob": prob}
        # each prompt consumed once: a refilled prompt was counted when it was skipped
        return experiences, consumed + self._skipping.skipped - self._skipping.refilled, exhausted

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        if self._groups is not None:  # a training batch (its filtered groups too), not an evaluation
            self._groups[prompt_key(response["prompt"], response["label"])].append(float(response["reward"]))
            self._generated_tokens += int(experience.action_mask.sum())
        return experience

    # ── checkpoints ──

    def skip_state(self) -> Dict:
        pending, skipped = (
            (self._skipping.pending, self._skipping.skipped_items) if self._skipping is not None else self._restored
        )
        return {
            "policy": self.policy.state_dict(),
            "batches": self.batches,
            "pending": list(pending),
            "skipped": list(skipped),
            "unlogged": dict(self._unlogged),
            "metrics": dict(self.last_metrics),
        }

    def load_skip_state(self, state: Dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.batches = int(state["batches"])
        self._unlogged = dict(state["unlogged"])
        self._restored = ([tuple(item) for item in state["pending"]], [tuple(item) for item in state["skipped"]])
        self._skipping = None
