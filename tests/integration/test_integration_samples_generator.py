"""Prompt skipping inside OpenRLHF's real ``SamplesGenerator`` (``integration.samples_generator``).

Upstream's ``generate_samples`` / ``_generate_vllm`` run as shipped (Ray refs, ``ray.wait``, dynamic filtering,
the epoch's exhaustion), over a stateful prompt dataloader like upstream's; only the vLLM call is replaced by refs
to ready-made responses whose rewards depend on the prompt: "easy" prompts are always solved (every group has
zero variance), the others get mixed rewards.
"""

from __future__ import annotations

import pytest
import ray
from torchdata.stateful_dataloader import StatefulDataLoader

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration.host import config_namespace, parse_host_args
from d3s_openrlhf.integration.samples_generator import STATE_KEY, D3SSamplesGenerator, prompt_key

PROMPTS = 24  # 12 easy, 12 mixed
B, G = 4, 4


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024**2)
    yield
    ray.shutdown()


def easy(prompt):
    return int(prompt[1:]) % 2 == 0


def collate(items):
    return tuple(list(column) for column in zip(*items))


def dataloader(batch_size=B):
    rows = [("src", f"p{i}", f"l{i}", None) for i in range(PROMPTS)]
    return StatefulDataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=collate)


def responses(prompt, label, n):
    rewards = [1.0] * n if easy(prompt) else [float(i % 2) for i in range(n)]
    return [
        dict(
            prompt=prompt,
            label=label,
            observation_tokens=[1, 2, 3, 4 + i],
            action_ranges=[(2, 4)],
            reward=reward,
            scores=reward,
            rollout_log_probs=None,
            extra_logs={},
        )
        for i, reward in enumerate(rewards)
    ]


class Generator(D3SSamplesGenerator):
    """The D3S generator with vLLM replaced by refs to ready responses; records what it dispatched."""

    dispatched: list

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        self.dispatched.extend(prompts)
        n = generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt)
        return [ray.put(responses(prompt, label, n)) for prompt, label in zip(prompts, labels)]


def make(*flags, loader_batch=B, **d3s):
    args = parse_host_args(["--rollout.batch_size", str(B), "--rollout.n_samples_per_prompt", str(G), *flags])
    fields = {"preset": "grpo", "prompt_skip": "history", "skip_init_prob": 0.9, "skip_max_prob": 0.9, **d3s}
    args.d3s = config_namespace(D3SConfig.from_flags(fields))
    strategy = type("Strategy", (), {"args": args})()
    generator = Generator(strategy, dataloader(loader_batch), dataloader(), tokenizer=None, vllm_engines=[])
    generator.dispatched = []
    return generator


def epoch(generator):
    """One pass over the prompts as upstream's trainer makes it: [(batch prompts, consumed, metrics)], a batch's
    prompts in dataloader order (responses arrive in Ray's completion order)."""
    batches = []
    while True:
        samples, _, consumed, exhausted = generator.generate_samples(max_len=64)
        prompts = sorted((s.prompts[0] for s in samples[::G]), key=lambda prompt: int(prompt[1:]))
        batches.append((prompts, consumed, dict(generator.last_metrics)))
        if exhausted:
            return batches


def test_easy_prompts_are_skipped_after_the_first_epoch_and_their_slots_refilled():
    generator = make()
    first = epoch(generator)
    assert sum(consumed for _, consumed, _ in first) == PROMPTS
    assert all(metrics["d3s/skipped_prompts"] == 0 for _, _, metrics in first)  # no history yet
    second = epoch(generator)
    generated = [prompt for prompts, _, _ in second for prompt in prompts]
    skipped = sum(metrics["d3s/skipped_prompts"] - metrics["d3s/refilled_prompts"] for _, _, metrics in second)
    # nothing lost, nothing counted twice: every prompt of the epoch was either generated or skipped, once
    assert len(generated) + skipped == sum(consumed for _, consumed, _ in second) == PROMPTS
    assert len(set(generated)) == len(generated)
    assert all(easy(prompt) for prompt in set(f"p{i}" for i in range(PROMPTS)) - set(generated))  # skipped: easy
    assert skipped >= 6  # about 90% of the 12 easy ones, less those that fill the last batch
    # every batch is full: skipped slots are refilled from the dataloader, and the last batch from the skipped
    full = [prompts for prompts, _, _ in second if prompts]
    assert all(len(prompts) == B for prompts in full) and len(generated) % B == 0
    assert second[-2][2]["d3s/refilled_prompts"] > 0 or len(generated) == PROMPTS
    assert second[0][2]["d3s/skip_candidates"] >= second[0][2]["d3s/skipped_prompts"] > 0
    assert second[0][2]["d3s/generated_tokens"] == B * G * 2  # 2 response tokens per rollout


def test_the_skip_probability_adapts_and_stays_below_one():
    generator = make(skip_init_prob=0.5, skip_max_prob=0.8, skip_rate=0.5, skip_target=0.0)
    probs = [metrics["d3s/skip_prob"] for _ in range(3) for _, _, metrics in epoch(generator)]
    assert probs[0] == 0.5 and max(probs) == 0.8  # half the groups have no variance: above the target of 0
    assert generator.policy.prob == 0.8


def test_evaluation_is_not_skipped_nor_recorded():
    generator = make()
    epoch(generator)
    state = generator.policy.state_dict()
    generator.dispatched.clear()
    generator.generate_eval_samples(max_len=64, n_samples_per_prompt=2)
    assert sorted(generator.dispatched) == sorted(f"p{i}" for i in range(PROMPTS))
    assert generator.policy.state_dict() == state


def test_a_resumed_generator_skips_as_the_uninterrupted_one():
    uninterrupted = make(skip_init_prob=0.5, loader_batch=5)  # dataloader batches that do not match B
    epoch(uninterrupted)
    uninterrupted.generate_samples(max_len=64)  # mid-epoch: the rest of a dataloader batch is pending
    state = uninterrupted.prompts_dataloader.state_dict()
    assert STATE_KEY in state and state[STATE_KEY]["pending"]
    resumed = make(skip_init_prob=0.5, loader_batch=5)
    resumed.prompts_dataloader.load_state_dict(state)
    resumed._dataloader_iter = iter(resumed.prompts_dataloader)  # what generate_samples does on a fresh start
    resumed._sample_buffer = []
    uninterrupted.dispatched.clear()
    rest = [(prompts, consumed) for prompts, consumed, _ in epoch(uninterrupted)]
    assert [(prompts, consumed) for prompts, consumed, _ in epoch(resumed)] == rest
    assert resumed.policy.state_dict() == uninterrupted.policy.state_dict()


def test_with_dynamic_filtering_no_prompt_is_counted_twice():
    # filtering drops the easy groups after generating them; skipping drops them before
    generator = make("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.0", "0.99")
    batches = epoch(generator) + epoch(generator)
    second = batches[len(batches) // 2 :]
    generated = [prompt for prompts, _, _ in batches for prompt in prompts]
    assert all(not easy(prompt) for prompt in generated)  # the filter passed mixed groups only
    skipped = sum(metrics["d3s/skipped_prompts"] for _, _, metrics in batches)
    refilled = sum(metrics["d3s/refilled_prompts"] for _, _, metrics in batches)
    assert skipped > 0
    # consumed = generated or filtered (upstream) + skipped (ours) - refilled (counted when skipped), once each
    assert sum(consumed for _, consumed, _ in batches) == 2 * PROMPTS
    assert len(generator.dispatched) + skipped - refilled == 2 * PROMPTS
    assert len(second) >= 1


def test_skip_off_is_upstreams_generator():
    generator = make(prompt_skip="off")
    batches = epoch(generator)
    assert [prompts for prompts, _, _ in batches if prompts] == [
        [f"p{i}" for i in range(j, j + B)] for j in range(0, PROMPTS, B)
    ]
    assert STATE_KEY not in generator.prompts_dataloader.state_dict() and generator.last_metrics == {}
    assert isinstance(generator.prompts_dataloader, StatefulDataLoader)


def test_prompt_keys_are_stable_and_distinguish_labels():
    assert prompt_key("p1", "l1") == prompt_key("p1", "l1") != prompt_key("p1", "l2")
