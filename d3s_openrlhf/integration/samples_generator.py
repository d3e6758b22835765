"""The generation level inside OpenRLHF's ``SamplesGenerator``: prompt skipping, screening by pilots, fixed steps.

``D3SSamplesGenerator`` replaces upstream's generator in the sync trainer and in the async generator actor. Its
training batches (``_generate_vllm`` on the prompt dataloader's iterator; evaluation is untouched) draw prompts from
a :class:`PromptStream`:

* **Fixed steps** (``host.fixed_steps``: skipping or screening on, or dynamic filtering with
  ``--d3s.schedule_steps``). The stream cycles over the dataloader's passes without end, so every batch holds B
  prompts; the generator serves exactly ``--d3s.schedule_steps`` S training batches and then reports the data
  exhausted, which ends upstream's loops (sync and async) after S steps whatever ``--train.num_episodes`` says.
* **Skipping** (``--d3s.prompt_skip history``): the stream asks the policy (``core.prompt_skip``) about each prompt
  and hands on the next one it keeps; upstream's loop, or the screened one, fills the batch.
* **Screening** (``--d3s.pilot_rollouts k``): :meth:`D3SSamplesGenerator._generate_screened` dispatches pilots of k
  rollouts ahead (``core.screening``), screens out the prompts whose pilot rewards are all equal, and generates the
  other G - k rollouts of the rest. A pilot that passes after its batch is full joins the next batch, one policy
  update old (as every rollout of async mode is; the actor recomputes the log-probs). Skip and audit decisions are
  keyed by the draw (``PromptStream.uniform``), not by the order pilots return; how many prompts a batch draws is
  not (docs/generation.md, Reproducibility).
* **Dynamic filtering** (``--algo.dynamic_filtering_enable``) with screening: the pilot screens out zero-variance
  groups, then upstream's range applies to the full group, and a group dropped by either draws one replacement
  prompt. Without screening, upstream's loop filters and draws its replacements from the stream. Either way a prompt
  is counted once in the prompts consumed, whether it was generated, screened, filtered or skipped.

Every pilot and every generated group is an observation of its prompt's history (the skip policy's streaks).

State: the prompt dataloader's state dict carries the generation level's state (key ``d3s_generation``: the batch
and step counters, the stream's passes and its few prompts read but not yet dispatched, the acceptance estimate, the
batch's metrics, and the skip policy's history), which both trainers save with every checkpoint and restore on
resume (``DataloaderWithGenerationState``). The history rides there, not in files of its own, because that state is
exactly what goes with the batch a checkpoint saves: in async mode the generator serves batches ahead of the
trainer, and each batch carries the state it was drawn with through the rollout queue. So every checkpoint upstream
can resume from, at ``--ckpt.save_steps`` or a new best at an ``--eval.steps`` (also with ``--ckpt.save_steps -1``),
holds the history of its own batch, and upstream's rotation (``--ckpt.max_num``, the best one replaced) removes it
with its checkpoint. The cost is that it rides the queue with every batch: the history holds the skip candidates
only, about 21 bytes each pickled, 0.2 MB for 10k and 2.1 MB for 100k (pickled in 1.4 and 48 ms), beside a batch
whose token ids alone are 16 MB at 1024 rollouts of 2k tokens.

Metrics of a step (logged by the trainer that receives the batch, sync or async): ``d3s/generated_tokens`` (response
tokens generated, pilots and filtered groups included), and with the levels on ``d3s/skipped_prompts``,
``d3s/skip_candidates``, ``d3s/skip_base``, ``d3s/screened_prompts``, ``d3s/pilots``, ``d3s/pilot_acceptance``,
``d3s/carried_pilots``, ``d3s/passes`` and, with ``--d3s.pilot_audit``, ``d3s/audited_prompts`` and
``d3s/false_rejects``. A step served from upstream's sample buffer without generating logs zeros.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

import ray
import torch
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from tqdm import tqdm

from d3s_openrlhf.core.screening import AcceptanceEstimate, pilot_room, pilots_to_dispatch
from d3s_openrlhf.core.selection import keyed_uniform
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
            "call fails (see its log); prompt skipping and screening (--d3s.prompt_skip "
            f"{config.prompt_skip}, --d3s.pilot_rollouts {config.pilot_rollouts}) need the reward of every rollout"
        )
    # the value as upstream stores it on the experience (torch.tensor([reward]): a Python float becomes fp32), so
    # that the screen and the experience maker's screening weights see the same ties
    reward = torch.tensor([reward]).item()
    if not math.isfinite(reward):
        raise RuntimeError(f"a non-finite reward {reward} for prompt {response.get('prompt', '')[:200]!r}")
    return reward


class PromptStream:
    """Training prompts one at a time from the prompt dataloader, without those the skip policy skips, cycling over
    passes without end (fixed steps). Iterating yields upstream's batch tuple of size 1, so upstream's loop can
    draw from it; :meth:`next_item` yields the item itself with its :data:`DrawKey`.

    Random decisions about a draw (skip it? audit its pilot?) read :meth:`uniform`, keyed by the seed, the batch and
    the draw: they do not depend on the order in which they are taken (pilots decide as they return).

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
        """The draw's uniform in ``stream`` (one per kind of decision): a function of the seed, the batch and the
        draw (the same prompt drawn twice in a batch draws twice)."""
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


@dataclass
class _ScreenedDraw:
    """One screened batch while its requests are in flight."""

    num_prompts: int
    group_size: int
    generate_kwargs: Dict
    pilots: Dict = field(default_factory=dict)  # ref -> (item, its draw key)
    rests: Dict = field(default_factory=dict)  # ref -> (item, pilot responses, audited: completed to count a reject)
    accepted: List = field(default_factory=list)  # the experiences of the batch
    started: int = 0  # groups whose rest is dispatched or done, less those dropped by the filter
    pilots_done: int = 0
    screened: int = 0


class D3SSamplesGenerator(SamplesGenerator):
    """``SamplesGenerator`` with the generation level (see the module docstring); upstream's loop, unchanged, when the
    run has no fixed steps (it then only counts the generated tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.d3s = config_from_args(self.args)
        self.policy = self.d3s.skip_policy() if self.d3s.skip_enabled else None
        self.acceptance = AcceptanceEstimate()
        self.prompts_dataloader = DataloaderWithGenerationState(self.prompts_dataloader, self)
        self.batches = 0  # training batches generated: with the seed, a key of each batch's random decisions
        self.steps_served = 0  # training batches handed to the trainer (fixed steps)
        self.stream: Optional[PromptStream] = None
        self._restored: Dict = {"pending": [], "passes": 0}  # the stream's part of a checkpoint
        self.rejected_in_a_row = 0  # prompts screened out or filtered since a group last joined a batch
        self._carried: List[Tuple[Item, List[Dict]]] = []  # accepted pilots of a full batch, for the next one
        self._groups: Optional[Dict[str, List[float]]] = None  # the rewards of each group, while a batch is drawn
        self._group: List = []  # the rollouts so far of the group upstream's loop is handing on
        self._decisions = [0, 0]  # the step's prompts (rejected, joined): its pass rate
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
        samples, pass_rate, consumed, exhausted = super().generate_samples(**generate_kwargs)
        rejected, joined = self._decisions
        if self.args.algo.dynamic_filtering_enable and rejected + joined:
            # upstream's rate is 100 x samples accepted / prompts consumed: G times a share, skipped prompts and the
            # groups of pilots carried from the batch before miscounted (None for a batch they fill alone: no prompt
            # consumed); logged instead: the share (%) of the prompts decided in the step (screened out, filtered,
            # or joined the batch) whose group joined it
            pass_rate = 100.0 * joined / (rejected + joined)
        counts = dict(self._counts)
        # a call without samples trains no step and logs nothing: its counts go to the next step that does
        for key, value in self._unlogged.items():
            counts[key] = counts.get(key, 0.0) + value
        self._unlogged = {} if samples else counts
        self.last_metrics = counts
        if self.policy is not None:
            self.last_metrics["d3s/skip_base"] = self.policy.base
        if counts.get("d3s/pilots"):  # (none in a step filled by the pilots carried from the last one)
            self.last_metrics["d3s/pilot_acceptance"] = 1.0 - counts["d3s/screened_prompts"] / counts["d3s/pilots"]
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
        if self.d3s.screening_enabled:
            names += ["d3s/pilots", "d3s/screened_prompts", "d3s/carried_pilots"]
            if self.args.algo.dynamic_filtering_enable:
                names.append("d3s/filtered_prompts")
            if self.d3s.pilot_audit:
                names += ["d3s/audited_prompts", "d3s/false_rejects"]
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
            if self.d3s.screening_enabled:
                experiences = self._generate_screened(num_prompts, dynamic_filtering, **generate_kwargs)
            else:
                upstream = super()._generate_vllm
                experiences, _, _ = upstream(self.stream, num_prompts, dynamic_filtering, **generate_kwargs)
            self.batches += 1
            self._observe_batch(self._groups)
            # each prompt consumed once, whether generated, screened, filtered or skipped (a carried pilot was
            # counted in the batch that drew it)
            return experiences, self.stream.drawn, False
        finally:
            self._groups = None

    def _decided(self, joined: bool) -> None:
        """A generated prompt's fate under screening or dynamic filtering: its group joined the batch, or it was
        screened out or filtered (a pilot that passes after the batch is full is decided when its group completes,
        in the next batch). Counted for the step's pass rate, and as the decisions come for the stall rule, so
        pilots dispatched ahead do not count before they return. --d3s.stall_passes passes over the prompts of
        rejections in a row, over batches, and a run at fixed steps cannot fill: it stops instead of cycling for
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
                "--d3s.stall_passes) were all screened out or filtered, none joined a batch: every pilot had equal "
                "rewards, or every group fell outside --algo.dynamic_filtering_range, so the run would cycle over the "
                "prompts for ever. Check the reward function (does it ever give one prompt different rewards?), widen "
                "the range, turn --d3s.pilot_rollouts or dynamic filtering off, or raise --d3s.stall_passes if "
                "groups with variance are that rare"
            )

    def _observe_batch(self, groups: Dict[str, List[float]]) -> None:
        """Record the batch's generated groups (pilots were recorded as they returned), adapt the skip policy and
        count the batch's draws."""
        if self.policy is None:
            return
        self._counts["d3s/skipped_prompts"] += self.stream.skipped
        self._counts["d3s/skip_candidates"] += self.stream.candidates
        flat = [self.policy.observe(key, rewards) for key, rewards in sorted(groups.items())]
        # screened batches observed their pilots as they returned (.get: a count that is not this run's metric stays
        # out of its metrics)
        observed = len(flat) + self._counts.get("d3s/pilots", 0.0)
        if observed:
            share = (sum(flat) + self._counts.get("d3s/screened_prompts", 0.0)) / observed
            self.policy.adapt(share, candidates_drawn=self.stream.candidates)

    def _generate_screened(self, num_prompts: int, dynamic_filtering, **generate_kwargs) -> List:
        """One batch of ``num_prompts`` groups that passed their pilot (and upstream's filter, if on)."""
        group_size = generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt)
        draw = _ScreenedDraw(num_prompts, group_size, generate_kwargs)
        pbar = tqdm(total=num_prompts, desc="Generate samples (screened)")
        self._top_up(draw)
        while draw.pilots or draw.rests:
            ready, _ = ray.wait([*draw.pilots, *draw.rests], num_returns=1, timeout=10.0)
            for ref in ready:
                responses = ray.get(ref)
                self._counts["d3s/generated_tokens"] += sum(_response_tokens(r) for r in responses)
                if ref in draw.pilots:
                    self._pilot_returned(draw, *draw.pilots.pop(ref), responses)
                elif self._rest_returned(draw, *draw.rests.pop(ref), responses, dynamic_filtering):
                    pbar.update()
            self._top_up(draw)
            pbar.set_postfix(screened=draw.screened, skipped=self.stream.skipped, pilots=draw.pilots_done)
        pbar.close()
        self.acceptance.update(draw.pilots_done - draw.screened, draw.pilots_done)
        self._counts["d3s/pilots"] += draw.pilots_done
        self._counts["d3s/screened_prompts"] += draw.screened
        self._counts["d3s/carried_pilots"] += len(self._carried)
        return draw.accepted

    def _start_rests(self, draw: _ScreenedDraw, groups: List[Tuple[Item, List, bool]]) -> None:
        """Dispatch the G - k rollouts that complete each (item, pilot responses, audited) group, in one call."""
        _, prompts, labels, images = zip(*(item for item, _, _ in groups))
        kwargs = {**draw.generate_kwargs, "n_samples_per_prompt": draw.group_size - self.d3s.pilot_rollouts}
        refs = self._dispatch_prompts_to_vllm(list(prompts), list(labels), images=list(images), **kwargs)
        draw.rests.update(zip(refs, groups))

    def _top_up(self, draw: _ScreenedDraw) -> None:
        """Complete the carried pilots first, then keep ceil(needed / acceptance) pilots in flight (core.screening)."""
        rests = []
        while self._carried and draw.started < draw.num_prompts:
            rests.append((*self._carried.pop(0), False))
            draw.started += 1
        if rests:
            self._start_rests(draw, rests)
        acceptance = self.acceptance.with_batch(draw.pilots_done - draw.screened, draw.pilots_done)
        open_slots = draw.num_prompts - draw.started
        room = pilot_room(open_slots, draw.num_prompts, len(self._carried))
        new = pilots_to_dispatch(open_slots, len(draw.pilots), acceptance, room)
        drawn = [self.stream.next_item() for _ in range(new)]
        if drawn:
            _, prompts, labels, images = zip(*(item for item, _ in drawn))
            kwargs = {**draw.generate_kwargs, "n_samples_per_prompt": self.d3s.pilot_rollouts}
            refs = self._dispatch_prompts_to_vllm(list(prompts), list(labels), images=list(images), **kwargs)
            draw.pilots.update(zip(refs, drawn))

    def _pilot_returned(self, draw: _ScreenedDraw, item: Item, draw_key: DrawKey, responses) -> None:
        """Screen a returned pilot: out if its rewards are all equal (audited by its own draw, whenever it returns),
        else its rest is dispatched, or it waits for the next batch if this one is full."""
        draw.pilots_done += 1
        rewards = [_reward(response, self.d3s) for response in responses]
        self._observe_pilot(item, rewards)
        if max(rewards) == min(rewards):
            draw.screened += 1
            self._decided(joined=False)
            if self.d3s.pilot_audit and self.stream.uniform("audit", draw_key) < self.d3s.pilot_audit:
                self._start_rests(draw, [(item, responses, True)])
        elif draw.started < draw.num_prompts:
            self._start_rests(draw, [(item, responses, False)])
            draw.started += 1
        else:
            self._carried.append((item, responses))

    def _rest_returned(self, draw: _ScreenedDraw, item: Item, pilot_responses, audited, responses, filtering) -> bool:
        """A completed group: counted if it was an audit, else accepted unless upstream's filter drops it (its slot
        then opens again). Returns whether it joined the batch."""
        group = [*pilot_responses, *responses]
        if audited:
            self._counts["d3s/audited_prompts"] += 1
            rewards = [_reward(response, self.d3s) for response in group]
            self._counts["d3s/false_rejects"] += max(rewards) != min(rewards)
            return False
        experiences = [self._process_response_into_experience(r, **draw.generate_kwargs) for r in group]
        if filtering and not self._passes_filter(experiences):
            draw.started -= 1
            self._counts["d3s/filtered_prompts"] += 1
            self._decided(joined=False)
            return False
        draw.accepted.extend(experiences)
        self._decided(joined=True)
        return True

    def _observe_pilot(self, item: Item, rewards: List[float]) -> None:
        """Record a pilot's rewards in the prompt's history."""
        if self.policy is not None:
            self.policy.observe(_item_key(item), rewards)

    def _passes_filter(self, experiences) -> bool:
        """Upstream's dynamic-filtering rule on a full group: its mean score strictly inside the range."""
        scores = [experience.scores[0].item() for experience in experiences if experience.scores is not None]
        if len(scores) < len(experiences):
            return True  # upstream filters only groups whose every rollout has a score
        low, high = self.args.algo.dynamic_filtering_range
        return low < sum(scores) / len(scores) < high

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        # a training batch; screening counts its tokens and observes its pilots as their refs return
        if self._groups is not None and not self.d3s.screening_enabled:
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
        carried = [item for item, _ in self._carried]  # a resume pilots them again
        pending = [*carried, *(stream.pending if stream is not None else self._restored["pending"])]
        return {
            "batches": self.batches,
            "steps_served": self.steps_served,
            "passes": stream.passes if stream is not None else self._restored["passes"],
            "rejected_in_a_row": self.rejected_in_a_row,
            "pending": [list(item) for item in pending],
            "acceptance": self.acceptance.state_dict(),
            "unlogged": dict(self._unlogged),
            "metrics": dict(self.last_metrics),
            "history": self.policy.state_dict() if self.policy is not None else None,
        }

    def load_generation_state(self, state: Dict) -> None:
        self.batches = int(state["batches"])
        self.steps_served = int(state["steps_served"])
        self.acceptance.load_state_dict(state["acceptance"])
        self._unlogged = dict(state["unlogged"])
        self._restored = {"pending": [tuple(item) for item in state["pending"]], "passes": int(state["passes"])}
        self.rejected_in_a_row = int(state.get("rejected_in_a_row", 0))  # a checkpoint from before the count: 0
        self._carried = []
        self.stream = None
        if self.policy is not None:
            if state.get("history") is None:
                raise ValueError(
                    f"the checkpoint of step {self.steps_served} that --ckpt.load_enable resumes holds no prompt "
                    "history (it was saved with --d3s.prompt_skip off, or by a d3s-openrlhf that kept the history in "
                    "<--ckpt.path>/d3s_history): resume it with --d3s.prompt_skip off, or start the run afresh"
                )
            self.policy.load_state_dict(state["history"])
