"""The generation level inside OpenRLHF's ``SamplesGenerator``: prompt skipping and fixed steps.

``D3SSamplesGenerator`` replaces upstream's generator in the sync trainer and in the async generator actor. Its
training batches (``_generate_vllm`` on the prompt dataloader's iterator; evaluation is untouched) draw prompts from
a :class:`PromptStream`, and upstream's loop, unchanged, fills them:

* **Fixed steps** (``host.fixed_steps``: skipping on, or dynamic filtering with ``--d3s.schedule_steps``). The
  stream cycles over the dataloader's passes without end, so every batch holds B prompts; the generator serves
  exactly ``--d3s.schedule_steps`` S training batches and then reports the data exhausted, which ends upstream's
  loops (sync and async) after S steps whatever ``--train.num_episodes`` says.
* **Skipping** (``--d3s.prompt_skip history``): the stream asks the policy (``core.prompt_skip``) about each prompt
  and hands on the next one it keeps. Skip decisions are keyed by the draw (``PromptStream.uniform``), not by the
  order of the draws (docs/generation.md, Reproducibility). Every generated group is an observation of its prompt's
  history (the skip policy's streaks).
* **Dynamic filtering** (``--algo.dynamic_filtering_enable``): upstream's loop filters and draws its replacements
  from the stream. A prompt is counted once in the prompts consumed, whether it was generated, filtered or skipped.
  The stall rule (``--d3s.stall_passes``) stops a run at fixed steps whose batches can never fill.

State: the prompt dataloader's state dict carries the generation level's state (key ``d3s_generation``: the batch
and step counters, the stream's passes and its few prompts read but not yet dispatched, the batch's metrics, and
the skip policy's history), which both trainers save with every checkpoint and restore on resume
(``DataloaderWithGenerationState``). The history rides there, not in files of its own, because that state is
exactly what goes with the batch a checkpoint saves: in async mode the generator serves batches ahead of the
trainer, and each batch carries the state it was drawn with through the rollout queue. So every checkpoint upstream
can resume from, at ``--ckpt.save_steps`` or a new best at an ``--eval.steps`` (also with ``--ckpt.save_steps -1``),
holds the history of its own batch, and upstream's rotation (``--ckpt.max_num``, the best one replaced) removes it
with its checkpoint. The cost is that it rides the queue with every batch: the history holds the skip candidates
only, about 21 bytes each pickled, 0.2 MB for 10k and 2.1 MB for 100k (pickled in 1.4 and 48 ms), beside a batch
whose token ids alone are 16 MB at 1024 rollouts of 2k tokens.

Metrics of a step (logged by the trainer that receives the batch, sync or async): ``d3s/generated_tokens`` (response
tokens generated, filtered groups included), with skipping ``d3s/skipped_prompts``, ``d3s/skip_candidates`` and
``d3s/skip_base``, at fixed steps ``d3s/passes``, and with dynamic filtering ``d3s/filter_pass_frac``. A step served
from upstream's sample buffer without generating logs zero counts.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, defaultdict, deque
from typing import Deque, Dict, List, Optional, Tuple

import torch

from d3s_openrlhf.core.selection import keyed_uniform
from d3s_openrlhf.integration.engine_gap import EngineLogprobsSamplesGenerator
from d3s_openrlhf.integration.host import config_from_args, fixed_steps

STATE_KEY = "d3s_generation"
"""Key of the generator's state (and the last batch's metrics) in the prompt dataloader's state dict."""

Item = Tuple  # (datasource, prompt, label, image): one prompt as the dataloader yields it
DrawKey = Tuple[str, int]  # one draw of a batch: its prompt's key, and how often the batch drew that prompt before


def _image_digest(image) -> bytes:
    """Stable bytes of a prompt's image(s): a path or URL as text, raw bytes, a PIL image's pixels."""
    if image is None:
        return b""
    if isinstance(image, (list, tuple)):
        return b"\1".join(_image_digest(part) for part in image)
    if isinstance(image, bytes):
        return image
    if isinstance(image, str):
        return image.encode()
    if hasattr(image, "tobytes"):
        return f"{getattr(image, 'size', '')}{getattr(image, 'mode', '')}".encode() + image.tobytes()
    return repr(image).encode()


def prompt_key(prompt: str, label, image=None) -> str:
    """A prompt's identity across passes and shuffles: a digest of its text, label and image (vision datasets
    repeat one text and label over many images)."""
    digest = hashlib.blake2b(f"{prompt}\0{label}\0".encode(), digest_size=8)
    digest.update(_image_digest(image))
    return digest.hexdigest()


def _item_key(item: Item) -> str:
    return prompt_key(item[1], item[2], item[3])


def _response_tokens(response) -> int:
    """Response tokens of one rollout (its action spans), whether or not it becomes an experience."""
    return sum(end - start for start, end in response["action_ranges"])


def _reward(response, config) -> float:
    reward = response.get("reward")
    if reward is None:
        raise RuntimeError(
            f"no reward for a rollout of prompt {response.get('prompt', '')[:200]!r}: the reward function (a "
            "--reward.remote_url server or file, or the agent) returned none, as upstream does when a remote reward "
            f"call fails (see its log); prompt skipping (--d3s.prompt_skip {config.prompt_skip}) needs the reward of "
            "every rollout"
        )
    # the value as upstream stores it on the experience (torch.tensor([reward]): a Python float becomes fp32), so
    # that the history sees the ties the experience maker sees
    reward = torch.tensor([reward]).item()
    if not math.isfinite(reward):
        raise RuntimeError(f"a non-finite reward {reward} for prompt {response.get('prompt', '')[:200]!r}")
    return reward


class PromptStream:
    """Training prompts one at a time from the prompt dataloader, without those the skip policy skips, cycling over
    passes without end (fixed steps). Iterating yields upstream's batch tuple of size 1, so upstream's loop can
    draw from it; :meth:`next_item` yields the item itself with its :data:`DrawKey`.

    Skip decisions read :meth:`uniform`, keyed by the seed, the batch and the draw: they do not depend on the order
    in which they are taken.

    Args:
        source: the iterator of the current pass (upstream's, which a resumed dataloader continues).
        dataloader: the prompt dataloader, iterated again for each further pass.
        seed: ``--d3s.seed``, of the decisions' draws.
        policy: the skip policy, or None (no skipping).
        pending: items read but not yet handed on (the rest of a dataloader batch, prompts of a checkpoint).
    """

    def __init__(self, source, dataloader, seed: int, policy=None, pending=(), passes: int = 0):
        self.source = source
        self.dataloader = dataloader
        self.seed = seed
        self.policy = policy
        self.pending: Deque[Item] = deque(tuple(item) for item in pending)
        self.passes = passes  # passes started after the first
        self.batch = 0  # the index of the batch being drawn (``start_batch``), a key of its draws
        self.occurrences: Counter = Counter()  # prompt key -> draws of it in the batch being drawn
        self.drawn = self.skipped = self.candidates = 0  # of the batch being drawn

    def start_batch(self, batch: int) -> None:
        self.batch = batch
        self.occurrences = Counter()
        self.drawn = self.skipped = self.candidates = 0

    def uniform(self, stream: str, draw_key: DrawKey) -> float:
        """The draw's uniform in ``stream`` (one per kind of decision, ``"skip"``): a function of the seed, the batch
        and the draw (the same prompt drawn twice in a batch draws twice)."""
        return keyed_uniform(self.seed, stream, self.batch, *draw_key)

    def _read(self) -> Item:
        while not self.pending:
            try:
                self.pending.extend(zip(*next(self.source)))
            except StopIteration:
                if len(self.dataloader) == 0:
                    raise
                self.source = iter(self.dataloader)  # the next pass: the run ends by steps, not by data
                self.passes += 1
        return self.pending.popleft()

    def next_item(self) -> Tuple[Item, DrawKey]:
        while True:
            item = self._read()
            self.drawn += 1
            key = _item_key(item)
            draw_key = (key, self.occurrences[key])
            self.occurrences[key] += 1
            if self.policy is not None and self.policy.is_candidate(key):
                self.candidates += 1
                if self.policy.skips(key, self.uniform("skip", draw_key)):
                    self.skipped += 1
                    continue
            return item, draw_key

    def __iter__(self):
        return self

    def __next__(self):
        (datasource, prompt, label, image), _ = self.next_item()
        return [datasource], [prompt], [label], [image]


class DataloaderWithGenerationState:
    """The prompt dataloader, whose state dict also holds the generator's state (and the last batch's metrics)."""

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
        return {**self.dataloader.state_dict(), STATE_KEY: self.owner.generation_state()}

    def load_state_dict(self, state):
        state = dict(state)
        generation = state.pop(STATE_KEY, None)
        self.dataloader.load_state_dict(state)
        if generation is not None:
            self.owner.load_generation_state(generation)


class D3SSamplesGenerator(EngineLogprobsSamplesGenerator):
    """``SamplesGenerator`` with the generation level (see the module docstring); upstream's loop, unchanged, when the
    run has no fixed steps (it then only counts the generated tokens). Under LoRA it asks for the engine's log-probs
    (``integration/engine_gap.py``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.d3s = config_from_args(self.args)
        self.policy = self.d3s.skip_policy() if self.d3s.skip_enabled else None
        self.prompts_dataloader = DataloaderWithGenerationState(self.prompts_dataloader, self)
        self.batches = 0  # training batches generated: with the seed, a key of each batch's random decisions
        self.steps_served = 0  # training batches handed to the trainer (fixed steps)
        self.stream: Optional[PromptStream] = None
        self._restored: Dict = {"pending": [], "passes": 0}  # the stream's part of a checkpoint
        self.rejected_in_a_row = 0  # groups filtered since a group last joined a batch
        self._groups: Optional[Dict[str, List[float]]] = None  # the rewards of each group, while a batch is drawn
        self._group: List = []  # the rollouts so far of the group upstream's loop is handing on
        self._decisions = [0, 0]  # the step's groups (filtered, joined)
        self._counts: Dict[str, float] = defaultdict(float)  # the step's counts
        self._unlogged: Dict[str, float] = {}
        self.last_metrics: Dict[str, float] = {}

    # ── the training batch ──

    def generate_samples(self, **generate_kwargs):
        fixed = fixed_steps(self.d3s, self.args)
        if fixed is not None and self.steps_served >= fixed:
            return [], None, 0, True
        # the step's counts, every one logged (zeros for a step served from upstream's sample buffer)
        self._counts = defaultdict(float, dict.fromkeys(self._metric_names(), 0.0))
        self._decisions = [0, 0]
        # upstream's pass rate goes on untouched (100 x samples / prompts consumed: G times a share, skipped prompts
        # counted); ours is the share of the step's generated groups that passed the filter
        samples, pass_rate, consumed, exhausted = super().generate_samples(**generate_kwargs)
        counts = dict(self._counts)
        # a call without samples trains no step and logs nothing: its counts go to the next step that does
        for key, value in self._unlogged.items():
            counts[key] = counts.get(key, 0.0) + value
        self._unlogged = {} if samples else counts
        self.last_metrics = dict(counts)  # and the step's values below, which are no counts to carry over
        filtered, joined = self._decisions
        if filtered + joined:
            self.last_metrics["d3s/filter_pass_frac"] = joined / (filtered + joined)
        if self.policy is not None:
            self.last_metrics["d3s/skip_base"] = self.policy.base
        if fixed is None:
            return samples, pass_rate, consumed, exhausted
        if samples:
            self.steps_served += 1
        self.last_metrics["d3s/passes"] = float(self.stream.passes + 1 if self.stream is not None else 1)
        return samples, pass_rate, consumed, self.steps_served >= fixed

    def _metric_names(self) -> List[str]:
        names = ["d3s/generated_tokens"]
        if self.d3s.skip_enabled:
            names += ["d3s/skipped_prompts", "d3s/skip_candidates"]
        return names

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):
        if dataloader_iter is not getattr(self, "_dataloader_iter", None):  # the evaluation's
            return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        self._groups = defaultdict(list)  # a training batch: its tokens are counted, its groups observed
        self._group = []
        try:
            if fixed_steps(self.d3s, self.args) is None:
                return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
            if self.stream is None:  # upstream's first-pass iterator (a resumed dataloader continues where it was)
                self.stream = PromptStream(
                    dataloader_iter, self.prompts_dataloader, self.d3s.seed, self.policy, **self._restored
                )
            self.stream.start_batch(self.batches)
            upstream = super()._generate_vllm
            experiences, _, _ = upstream(self.stream, num_prompts, dynamic_filtering, **generate_kwargs)
            self.batches += 1
            self._observe_batch(self._groups)
            # each prompt consumed once, whether generated, filtered or skipped
            return experiences, self.stream.drawn, False
        finally:
            self._groups = None

    def _decided(self, joined: bool) -> None:
        """A generated group's fate under dynamic filtering: it joined the batch, or the filter dropped it. Counted
        for the step's pass rate, and for the stall rule: --d3s.stall_passes passes over the prompts of groups
        filtered in a row, over batches, and a run at fixed steps cannot fill: it stops instead of cycling for
        ever."""
        self._decisions[joined] += 1
        if joined:
            self.rejected_in_a_row = 0
            return
        self.rejected_in_a_row += 1
        dataset = getattr(self.prompts_dataloader, "dataset", None)
        limit = self.d3s.stall_passes * (len(dataset) if dataset is not None else len(self.prompts_dataloader))
        if self.stream is not None and self.rejected_in_a_row > limit:
            raise RuntimeError(
                f"the last {limit} prompts generated ({self.d3s.stall_passes} passes over the prompts, "
                "--d3s.stall_passes) were all filtered, none joined a batch: every group fell outside "
                "--algo.dynamic_filtering_range, so the run would cycle over the prompts for ever. Check the reward "
                "function (does it ever give one prompt different rewards?), widen the range, turn dynamic filtering "
                "off, or raise --d3s.stall_passes if groups with variance are that rare"
            )

    def _observe_batch(self, groups: Dict[str, List[float]]) -> None:
        """Record the batch's generated groups, adapt the skip policy and count the batch's draws."""
        if self.policy is None:
            return
        self._counts["d3s/skipped_prompts"] += self.stream.skipped
        self._counts["d3s/skip_candidates"] += self.stream.candidates
        flat = [self.policy.observe(key, rewards) for key, rewards in sorted(groups.items())]
        if flat:
            self.policy.adapt(sum(flat) / len(flat), candidates_drawn=self.stream.candidates)

    def _passes_filter(self, experiences) -> bool:
        """Upstream's dynamic-filtering rule on a full group: its mean score strictly inside the range."""
        scores = [experience.scores[0].item() for experience in experiences if experience.scores is not None]
        if len(scores) < len(experiences):
            return True  # upstream filters only groups whose every rollout has a score
        low, high = self.args.algo.dynamic_filtering_range
        return low < sum(scores) / len(scores) < high

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        if self._groups is not None:  # a training batch
            self._counts["d3s/generated_tokens"] += _response_tokens(response)
            if self.policy is not None:
                key = prompt_key(response["prompt"], response["label"], response.get("images"))
                self._groups[key].append(_reward(response, self.d3s))
            if self.args.algo.dynamic_filtering_enable:
                self._group_member_returned(experience, generate_kwargs)
        return experience

    def _group_member_returned(self, experience, generate_kwargs) -> None:
        """Upstream's filtering loop hands on a group's rollouts one after another (one request a group): at the
        group's last one, it joins the batch unless upstream's filter drops it."""
        self._group.append(experience)
        if len(self._group) < generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt):
            return
        passed = self._passes_filter(self._group)
        self._group = []
        self._decided(passed)

    # ── checkpoints ──

    def generation_state(self) -> Dict:
        """The state that rides in the dataloader's state dict: bounded by a batch, but for the history."""
        stream = self.stream
        return {
            "batches": self.batches,
            "steps_served": self.steps_served,
            "passes": stream.passes if stream is not None else self._restored["passes"],
            "rejected_in_a_row": self.rejected_in_a_row,
            "pending": [list(item) for item in (stream.pending if stream is not None else self._restored["pending"])],
            "unlogged": dict(self._unlogged),
            "metrics": dict(self.last_metrics),
            "history": self.policy.state_dict() if self.policy is not None else None,
        }

    def load_generation_state(self, state: Dict) -> None:
        """Resume from a checkpoint's state. One written with the removed screening (``--d3s.pilot_rollouts``)
        resumes too: its carried pilots are prompts in ``pending`` (drawn first, generated whole), and its
        acceptance estimate and screening counts are dropped."""
        steps_served = int(state["steps_served"])
        if steps_served and fixed_steps(self.d3s, self.args) is None:
            raise ValueError(
                f"the checkpoint of step {steps_served} that --ckpt.load_enable resumes was saved by a run at fixed "
                "steps (--d3s.schedule_steps with --d3s.prompt_skip history, with --algo.dynamic_filtering_enable, or "
                "with the removed screening, --d3s.pilot_rollouts), but this run trains upstream's passes over the "
                "data: resume it with --d3s.schedule_steps S and --d3s.prompt_skip history or "
                "--algo.dynamic_filtering_enable (which drops the groups without reward variance after generation, "
                "as screening did before it), or start the run afresh"
            )
        self.batches = int(state["batches"])
        self.steps_served = steps_served
        names = self._metric_names()
        self._unlogged = {key: value for key, value in state["unlogged"].items() if key in names}
        self._restored = {"pending": [tuple(item) for item in state["pending"]], "passes": int(state["passes"])}
        self.rejected_in_a_row = int(state.get("rejected_in_a_row", 0))  # a checkpoint from before the count: 0
        self.stream = None
        if self.policy is not None:
            if state.get("history") is None:
                raise ValueError(
                    f"the checkpoint of step {self.steps_served} that --ckpt.load_enable resumes holds no prompt "
                    "history (it was saved with --d3s.prompt_skip off, or by a d3s-openrlhf that kept the history in "
                    "<--ckpt.path>/d3s_history): resume it with --d3s.prompt_skip off, or start the run afresh"
                )
            self.policy.load_state_dict(state["history"])
