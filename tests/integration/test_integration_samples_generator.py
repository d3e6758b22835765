"""The generation level inside OpenRLHF's real ``SamplesGenerator`` (``integration.samples_generator``): skipping,
screening by pilots, fixed steps, state.

Upstream's ``generate_samples`` / ``_generate_vllm`` run as shipped (Ray refs, ``ray.wait``, dynamic filtering,
the sample buffer), over a stateful prompt dataloader like upstream's; only the vLLM call is replaced by refs to
ready-made responses whose rewards depend on the prompt: "easy" prompts are always solved (every group and pilot
has zero variance), the others get alternating rewards (every pilot of 2 or more has variance).
"""

from __future__ import annotations

import os

import pytest
import ray
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.integration.host import config_namespace, parse_host_args
from d3s_openrlhf.integration.samples_generator import HISTORY_DIR, STATE_KEY, D3SSamplesGenerator, prompt_key

PROMPTS = 24  # 12 easy, 12 mixed
B, G, K = 4, 5, 2  # the rest of a group (G - K = 3) is told from its pilot (K = 2) by its size


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024**2)
    yield
    ray.shutdown()


def easy(prompt):
    return not prompt[1:].isdigit() or int(prompt[1:]) % 2 == 0


def collate(items):
    return tuple(list(column) for column in zip(*items))


def dataloader(batch_size=1, prompts=PROMPTS, images=None):
    rows = [("src", f"p{i}", f"l{i}", images[i] if images else None) for i in range(prompts)]
    return StatefulDataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=collate)


def responses(prompt, label, n, image=None, rewarded=True, flat=False):
    rewards = [1.0] * n if flat or easy(prompt) else [float(i % 2) for i in range(n)]
    return [
        dict(
            prompt=prompt,
            label=label,
            images=image,
            observation_tokens=[1, 2, 3, 4 + i],
            action_ranges=[(2, 4)],
            reward=reward if rewarded else None,  # upstream's None: a remote reward call that failed
            scores=reward,
            rollout_log_probs=None,
            extra_logs={},
        )
        for i, reward in enumerate(rewards)
    ]


class Generator(D3SSamplesGenerator):
    """The D3S generator with vLLM replaced by refs to ready responses; records what it dispatched."""

    dispatched: list  # (prompt, rollouts)
    rewarded = True
    flat = False  # every prompt solved

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        n = generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt)
        self.dispatched.extend((prompt, n) for prompt in prompts)
        images = images or [None] * len(prompts)
        return [
            ray.put(responses(prompt, label, n, image, self.rewarded, self.flat))
            for prompt, label, image in zip(prompts, labels, images)
        ]


def make(*flags, loader=None, ckpt=None, **d3s):
    host = ["--rollout.batch_size", str(B), "--rollout.n_samples_per_prompt", str(G), *flags]
    if ckpt is not None:
        host += ["--ckpt.path", str(ckpt), "--ckpt.save_steps", "2"]
    args = parse_host_args(host)
    fields = {"preset": "grpo", "prompt_skip": "history", "schedule_steps": 12, "skip_base": 0.05, **d3s}
    args.d3s = config_namespace(D3SConfig.from_flags(fields))
    strategy = type("Strategy", (), {"args": args})()
    generator = Generator(strategy, loader or dataloader(), dataloader(), tokenizer=None, vllm_engines=[])
    generator.dispatched = []
    return generator


def run(generator, steps=None):
    """Steps as upstream's trainer takes them until the generator says it is done: [(the prompt of each group of the
    batch, sorted, the set of group sizes, consumed, metrics)]. A group is G consecutive samples of one prompt, as
    the experience maker reads them (a prompt may come twice in a batch once the passes cycle)."""
    taken = []
    while steps is None or len(taken) < steps:
        samples, _, consumed, exhausted = generator.generate_samples(max_len=64)
        if samples:
            groups = [samples[i : i + G] for i in range(0, len(samples), G)]
            assert all(len({sample.prompts[0] for sample in group}) == 1 for group in groups)
            prompts = sorted((group[0].prompts[0] for group in groups), key=lambda prompt: (len(prompt), prompt))
            sizes = {len(group) for group in groups} | {len(samples) % G or G}
            taken.append((prompts, sizes, consumed, dict(generator.last_metrics)))
        if exhausted:
            break
    return taken


@pytest.mark.parametrize(
    "flags, level",
    [
        ((), dict(prompt_skip="history")),
        ((), dict(prompt_skip="off", pilot_rollouts=K)),
        (("--algo.dynamic_filtering_enable",), dict(prompt_skip="off", chunked_logits=True)),  # upstream's filter
    ],
)
def test_the_run_trains_exactly_the_fixed_steps_of_full_batches_cycling_over_the_prompts(flags, level):
    generator = make(*flags, **level)
    steps = run(generator)
    assert len(steps) == 12  # --d3s.schedule_steps, whatever the passes (12 x 4 = 48 draws of 24 prompts)
    assert all(len(prompts) == B and groups == {G} for prompts, groups, _, _ in steps)  # full batches of full groups
    assert generator.generate_samples(max_len=64) == ([], None, 0, True)  # and then done
    assert steps[-1][3]["d3s/passes"] >= 2
    assert all(metrics["d3s/generated_tokens"] > 0 for *_, metrics in steps)


def test_easy_prompts_are_skipped_once_seen_and_every_draw_is_counted_once():
    generator = make()
    steps = run(generator)
    first_pass = steps[: PROMPTS // B]
    assert all(metrics["d3s/skipped_prompts"] == 0 for *_, metrics in first_pass[:1])  # no history yet
    later = [prompt for prompts, *_ in steps[PROMPTS // B + 1 :] for prompt in prompts]
    assert sum(map(easy, later)) <= 0.2 * len(later)  # candidates are skipped with 1 - 0.05^c, floor 1%
    skipped = sum(metrics["d3s/skipped_prompts"] for *_, metrics in steps)
    consumed = sum(consumed for _, _, consumed, _ in steps)
    assert consumed == len(generator.dispatched) + skipped  # generated or skipped, once each
    assert skipped > 0 and all(
        metrics["d3s/skip_candidates"] >= metrics["d3s/skipped_prompts"] for *_, metrics in steps
    )


def test_pilots_screen_out_zero_variance_prompts_and_the_rest_completes_the_group():
    generator = make(prompt_skip="off", pilot_rollouts=K)
    steps = run(generator)
    trained = [prompt for prompts, *_ in steps for prompt in prompts]
    assert not any(map(easy, trained))  # a pilot with variance makes a group with variance: nothing flat trained
    pilots = [prompt for prompt, n in generator.dispatched if n == K]
    rests = [prompt for prompt, n in generator.dispatched if n == G - K]
    assert set(rests) <= set(pilots) and all(not easy(prompt) for prompt in rests)
    screened = sum(metrics["d3s/screened_prompts"] for *_, metrics in steps)
    carried = steps[-1][3]["d3s/carried_pilots"]
    assert screened == sum(map(easy, pilots))
    # every prompt drawn once: as a trained group, a screened pilot, or a pilot carried past the last step
    assert sum(consumed for _, _, consumed, _ in steps) == len(pilots) == len(trained) + screened + carried
    assert steps[0][3]["d3s/pilot_acceptance"] == pytest.approx(0.5, abs=0.26)
    # every rollout generated is counted once, pilots included, in the step that generated it
    tokens = sum(metrics["d3s/generated_tokens"] for *_, metrics in steps)
    assert tokens == 2 * sum(n for _, n in generator.dispatched)


def test_pilots_that_pass_after_the_batch_is_full_join_the_next_batch():
    generator = make(prompt_skip="off", pilot_rollouts=K)
    # half the pilots pass: pilots are provisioned for that, so some pass after their batch is full
    steps = run(generator, steps=1)
    while not generator._carried:
        steps += run(generator, steps=1)
    assert steps[-1][3]["d3s/pilots"] > B
    carried = [item[1] for item, _ in generator._carried]
    # their prompts travel with a checkpoint (a resume pilots them again) and lead the next batch
    pending = [item[1] for item in generator.prompts_dataloader.state_dict()[STATE_KEY]["pending"]]
    assert pending[: len(carried)] == carried
    assert set(carried[:B]) <= set(run(generator, steps=1)[0][0])


def test_the_audit_completes_screened_groups_without_training_them():
    generator = make(prompt_skip="off", pilot_rollouts=K, pilot_audit=1.0, schedule_steps=3)
    steps = run(generator)
    audited = sum(metrics["d3s/audited_prompts"] for *_, metrics in steps)
    screened = sum(metrics["d3s/screened_prompts"] for *_, metrics in steps)
    assert audited == screened > 0  # every screened prompt completed (an easy one: its full group is flat too)
    assert sum(metrics["d3s/false_rejects"] for *_, metrics in steps) == 0
    assert not any(easy(prompt) for prompts, *_ in steps for prompt in prompts)  # audited groups never trained
    rests = [prompt for prompt, n in generator.dispatched if n == G - K]
    assert sum(map(easy, rests)) == audited


def test_history_counts_pilots_and_a_skipped_prompt_costs_no_pilot():
    generator = make(pilot_rollouts=K)
    steps = run(generator)
    pilots = [prompt for prompt, n in generator.dispatched if n == K]
    easy_pilots = [prompt for prompt in pilots if easy(prompt)]
    # after its first screened pilot an easy prompt is a candidate, skipped with 1 - 0.05^c: few pilots again
    assert len(easy_pilots) <= 12 + 0.2 * (len(easy_pilots) + 12)
    assert sum(metrics["d3s/skipped_prompts"] for *_, metrics in steps) > 0
    assert all(generator.policy.streak(prompt_key(f"p{i}", f"l{i}")) >= 1 for i in range(0, PROMPTS, 2))


def test_screening_with_dynamic_filtering_counts_each_prompt_once():
    filtering = ("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9")
    generator = make(*filtering, prompt_skip="off", pilot_rollouts=K, schedule_steps=4)
    steps = run(generator)
    assert len(steps) == 4 and all(len(prompts) == B for prompts, *_ in steps)
    pilots = [prompt for prompt, n in generator.dispatched if n == K]
    screened = sum(metrics["d3s/screened_prompts"] for *_, metrics in steps)
    trained = sum(len(prompts) for prompts, *_ in steps)
    carried = steps[-1][3]["d3s/carried_pilots"]
    assert sum(consumed for _, _, consumed, _ in steps) == len(pilots) == trained + screened + carried


def test_a_group_dropped_by_dynamic_filtering_is_replaced_and_counted_once():
    generator = make("--algo.dynamic_filtering_enable", prompt_skip="off", pilot_rollouts=K, schedule_steps=1)
    verdicts = iter([False, False, False])  # upstream's range drops the first three full groups
    generator._passes_filter = lambda experiences: next(verdicts, True)
    ((prompts, _, consumed, metrics),) = run(generator)
    assert metrics["d3s/filtered_prompts"] == 3 and len(prompts) == B
    pilots = [prompt for prompt, n in generator.dispatched if n == K]
    carried = metrics["d3s/carried_pilots"]
    assert consumed == len(pilots) == B + 3 + metrics["d3s/screened_prompts"] + carried


@pytest.mark.parametrize("low, high, passes", [(0.1, 0.9, True), (0.6, 0.99, False), (0.0, 0.4, False)])
def test_the_filter_on_full_groups_is_upstreams_strict_range(low, high, passes):
    filtering = ("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", str(low), str(high))
    generator = make(*filtering, prompt_skip="off", pilot_rollouts=K)
    group = [generator._process_response_into_experience(r, max_len=64) for r in responses("p1", "l1", G)]
    assert generator._passes_filter(group) is passes  # mean 2 / 5


@pytest.mark.parametrize(
    "flags, d3s",
    [
        ((), dict(prompt_skip="off", pilot_rollouts=K)),  # every pilot flat
        (("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.9", "0.95"), {}),  # none in range
    ],
    ids=["screening", "filtering"],
)
def test_a_batch_that_can_never_fill_stops_the_run_instead_of_cycling(flags, d3s):
    generator = make(*flags, **d3s)
    generator.flat = True
    with pytest.raises(RuntimeError, match="without filling up: every pilot had equal rewards"):
        generator.generate_samples(max_len=64)


FILTER = ("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9")


@pytest.mark.parametrize(
    "d3s",
    [
        {},  # skipping
        dict(prompt_skip="off", pilot_rollouts=K),  # screening
        dict(prompt_skip="off", chunked_logits=True),  # upstream's filter alone, at fixed steps
        dict(prompt_skip="off", schedule_steps=0, sample_rule="max_var", n_init=2, n_final=2),  # upstream's loop
    ],
    ids=["skipping", "screening", "filtering", "upstream_loop"],
)
def test_the_pass_rate_is_the_share_of_prompts_generated_whose_group_passed(d3s):
    # upstream divides samples by prompts (G times the share); with G = 5 a step is 4 groups of 5 samples
    generator = make(*FILTER, **d3s)
    rates = []
    while True:
        samples, rate, consumed, exhausted = generator.generate_samples(max_len=64)
        skipped = generator.last_metrics.get("d3s/skipped_prompts", 0)
        if samples:  # (upstream's loop ends with a call that generates nothing)
            rates.append((rate, len(samples) // G, consumed - skipped))
        if exhausted:
            break
    for rate, groups, generated in rates:
        assert rate == pytest.approx(100 * groups / generated)  # the prompts skipped were not generated
    # (with screening a batch may also take pilots that the one before drew and counted)
    assert all(0 < rate <= 100 for rate, *_ in rates if d3s.get("pilot_rollouts") is None)
    assert any(rate < 100 for rate, *_ in rates)  # the mixed prompts' groups pass the range, the easy ones not


def test_steps_served_from_the_sample_buffer_log_no_second_copy_of_the_counts():
    generator = make("--rollout.vllm_generate_batch_size", str(2 * B), prompt_skip="off", pilot_rollouts=K)
    first, second = run(generator, steps=2)
    assert first[3]["d3s/pilots"] > 0 and first[3]["d3s/generated_tokens"] > 0
    assert second[3]["d3s/pilots"] == 0 and second[3]["d3s/generated_tokens"] == 0  # served from the buffer


def test_the_state_that_travels_stays_small_and_the_history_is_checkpointed_beside(tmp_path):
    small = make(ckpt=tmp_path / "a")
    large = make(ckpt=tmp_path / "b", loader=dataloader(prompts=2000))
    run(small, steps=6)
    run(large, steps=6)
    small_state, large_state = (g.prompts_dataloader.state_dict()[STATE_KEY] for g in (small, large))
    assert set(small_state) == set(large_state)
    assert len(repr(large_state)) < 2 * len(repr(small_state)) + 500  # no history, no list of skipped prompts
    assert sorted(os.listdir(tmp_path / "a" / HISTORY_DIR)) == ["step2.pt", "step4.pt", "step6.pt"]


def test_a_resumed_generator_draws_as_the_uninterrupted_one(tmp_path):
    uninterrupted = make(ckpt=tmp_path)
    run(uninterrupted, steps=4)
    state = uninterrupted.prompts_dataloader.state_dict()
    resumed = make(ckpt=tmp_path)
    resumed.prompts_dataloader.load_state_dict(state)
    assert resumed.policy.state_dict() == uninterrupted.policy.state_dict()
    rest = run(uninterrupted)
    assert [step[:3] for step in run(resumed)] == [step[:3] for step in rest]
    assert len(rest) == 12 - 4


def test_a_resume_without_its_history_is_refused_with_the_path(tmp_path):
    generator = make(ckpt=tmp_path)
    run(generator, steps=2)
    state = generator.prompts_dataloader.state_dict()
    os.remove(tmp_path / HISTORY_DIR / "step2.pt")
    with pytest.raises(FileNotFoundError, match="prompt history of step 2 .*step2.pt"):
        make(ckpt=tmp_path).prompts_dataloader.load_state_dict(state)


@pytest.mark.parametrize("screen", [0, K])
def test_a_missing_reward_is_a_clear_error(screen):
    generator = make(pilot_rollouts=screen)
    generator.rewarded = False
    with pytest.raises(RuntimeError, match=r"no reward for a rollout of prompt 'p\d+'.*--reward.remote_url"):
        generator.generate_samples(max_len=64)


def test_evaluation_is_neither_screened_nor_skipped_nor_recorded():
    generator = make(pilot_rollouts=K)
    run(generator, steps=3)
    state = generator.policy.state_dict()
    generator.dispatched.clear()
    generator.generate_eval_samples(max_len=64, n_samples_per_prompt=3)
    assert sorted(generator.dispatched) == sorted((f"p{i}", 3) for i in range(PROMPTS))
    assert generator.policy.state_dict() == state


def test_d3s_without_the_generation_level_is_upstreams_loop_and_counts_tokens():
    generator = make(prompt_skip="off", schedule_steps=0, sample_rule="max_var", n_init=2, n_final=2)
    steps = run(generator)
    assert [prompts for prompts, *_ in steps] == [[f"p{i}" for i in range(j, j + B)] for j in range(0, PROMPTS, B)]
    assert all(metrics["d3s/generated_tokens"] == B * G * 2 for *_, metrics in steps)
    assert "d3s/skipped_prompts" not in steps[0][3] or steps[0][3]["d3s/skipped_prompts"] == 0


def test_prompt_keys_are_stable_and_distinguish_labels_and_images():
    assert prompt_key("p1", "l1") == prompt_key("p1", "l1") != prompt_key("p1", "l2")
    assert prompt_key("p1", "l1", "a.png") != prompt_key("p1", "l1", "b.png")
    assert prompt_key("p1", "l1", ["a.png"]) == prompt_key("p1", "l1", ["a.png"])
    pixels = torch.zeros(2, 2, dtype=torch.uint8).numpy()
    assert prompt_key("p1", "l1", pixels) != prompt_key("p1", "l1", pixels + 1)


def test_two_equal_texts_with_other_images_are_two_prompts():
    rows = [("src", "same", "label", f"img{i}.png") for i in range(8)]
    loader = StatefulDataLoader(rows, batch_size=1, shuffle=False, collate_fn=collate)
    generator = make(loader=loader, schedule_steps=2)
    run(generator)
    # one history entry per image, each a group of G rewards (one text would merge them into one group of 2G)
    assert len(generator.policy.streaks) == 2 * B
    assert all(streak == 1 for streak in generator.policy.streaks.values())
