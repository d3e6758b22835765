"""The generation level inside OpenRLHF's real ``SamplesGenerator`` (``integration.samples_generator``): skipping,
fixed steps, dynamic filtering's stall rule and pass rate, state.

Upstream's ``generate_samples`` / ``_generate_vllm`` run as shipped (Ray refs, ``ray.wait``, dynamic filtering,
the sample buffer), over a stateful prompt dataloader like upstream's; only the vLLM call is replaced by refs to
ready-made responses whose rewards depend on the prompt: "easy" prompts are always solved (every group has zero
variance), the others get alternating rewards (every group has variance).
"""

from __future__ import annotations

import random

import pytest
import ray
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.core.selection import step_generator
from d3s_openrlhf.cpu import runtime
from d3s_openrlhf.integration.host import config_namespace, parse_host_args
from d3s_openrlhf.integration.samples_generator import (
    STATE_KEY,
    D3SSamplesGenerator,
    PromptStream,
    _reward,
    prompt_key,
)

PROMPTS = 24  # 12 easy, 12 mixed
B, G = 4, 5
FILTER = ("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    runtime.init_local_ray(num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024**2)
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
    mixed = None  # the only prompts whose groups have variance (None: the odd ones)

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        n = generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt)
        self.dispatched.extend((prompt, n) for prompt in prompts)
        images = images or [None] * len(prompts)
        return [
            ray.put(responses(prompt, label, n, image, self.rewarded, self.flat or self.mixed not in (None, {prompt})))
            for prompt, label, image in zip(prompts, labels, images)
        ]


def make(*flags, loader=None, **d3s):
    host = ["--rollout.batch_size", str(B), "--rollout.n_samples_per_prompt", str(G), *flags]
    args = parse_host_args(host)
    fields = {"preset": "grpo", "prompt_skip": "history", "schedule_steps": 12, "skip_base": 0.05, **d3s}
    args.d3s = config_namespace(D3SConfig.from_flags(fields))
    strategy = type("Strategy", (), {"args": args})()
    generator = Generator(strategy, loader or dataloader(), dataloader(), tokenizer=None, vllm_engines=[])
    generator.dispatched = []
    return generator


def run(generator, steps=None, calls=100):
    """Steps as upstream's trainer takes them until the generator says it is done: [(the prompt of each group of the
    batch, sorted, the set of group sizes, consumed, metrics)]. A group is G consecutive samples of one prompt, as
    the experience maker reads them (a prompt may come twice in a batch once the passes cycle). Fails after
    ``calls`` calls that did neither."""
    taken = []
    for _ in range(calls):
        if steps is not None and len(taken) >= steps:
            break
        samples, _, consumed, exhausted = generator.generate_samples(max_len=64)
        if samples:
            groups = [samples[i : i + G] for i in range(0, len(samples), G)]
            assert all(len({sample.prompts[0] for sample in group}) == 1 for group in groups)
            prompts = sorted((group[0].prompts[0] for group in groups), key=lambda prompt: (len(prompt), prompt))
            sizes = {len(group) for group in groups} | {len(samples) % G or G}
            taken.append((prompts, sizes, consumed, dict(generator.last_metrics)))
        if exhausted:
            break
    else:
        assert steps is not None and len(taken) >= steps, f"not done after {calls} calls"
    return taken


@pytest.mark.parametrize(
    "flags, level",
    [
        ((), dict(prompt_skip="history")),
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


def test_a_group_dropped_by_dynamic_filtering_is_replaced_and_counted_once():
    generator = make(*FILTER, prompt_skip="off", chunked_logits=True, schedule_steps=1)
    ((prompts, _, consumed, metrics),) = run(generator)  # the even prompts are flat: upstream's range drops them
    assert prompts == ["p1", "p3", "p5", "p7"]
    assert consumed == len(generator.dispatched) == B + 4  # each of p0, p2, p4, p6 replaced by one draw
    assert metrics["d3s/filter_pass_frac"] == B / (B + 4)


@pytest.mark.parametrize("low, high, passes", [(0.1, 0.9, True), (0.6, 0.99, False), (0.0, 0.4, False)])
def test_the_filter_on_full_groups_is_upstreams_strict_range(low, high, passes):
    filtering = ("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", str(low), str(high))
    generator = make(*filtering, prompt_skip="off", chunked_logits=True)
    group = [generator._process_response_into_experience(r, max_len=64) for r in responses("p1", "l1", G)]
    assert generator._passes_filter(group) is passes  # mean 2 / 5


# a group joins only with variance: upstream's default range (0, 1) drops the flat ones
FILLS_WITH_VARIANCE = ("--algo.dynamic_filtering_enable",)


@pytest.mark.parametrize("stall_passes", [1, 4])
def test_a_run_that_can_never_fill_stops_after_the_stall_passes(stall_passes):
    """At 0% acceptance: stopped once --d3s.stall_passes passes over the prompts went by without a group joining,
    with the flags to change; not before."""
    generator = make(*FILLS_WITH_VARIANCE, stall_passes=stall_passes)
    generator.flat = True
    message = f"the last {stall_passes * PROMPTS} prompts generated .*--d3s.stall_passes.* none joined a batch"
    with pytest.raises(RuntimeError, match=message):
        generator.generate_samples(max_len=64)
    assert generator.rejected_in_a_row == stall_passes * PROMPTS + 1


def test_a_run_that_fills_slowly_goes_on_however_many_passes_a_batch_takes():
    """At 1% acceptance (one prompt in 100 has variance) a batch of 8 groups takes 8 passes over the prompts, beyond
    any per-batch allowance, and the run goes on: a group joins every pass, within --d3s.stall_passes 2."""
    slow = dict(stall_passes=2, schedule_steps=2)
    flags = (*FILLS_WITH_VARIANCE, "--rollout.batch_size", "8")
    generator = make(*flags, loader=dataloader(prompts=100), **slow)
    generator.mixed = {"p7"}
    steps = run(generator)
    assert [prompts for prompts, *_ in steps] == [["p7"] * 8] * 2
    assert generator.last_metrics["d3s/passes"] >= 16
    # the count goes on over batches and through a checkpoint: resumed 57 rejections after a join, a run that can no
    # longer fill stops 43 rejections later at --d3s.stall_passes 1
    state = generator.prompts_dataloader.state_dict()
    assert 0 <= state[STATE_KEY]["rejected_in_a_row"] < 100
    state[STATE_KEY]["rejected_in_a_row"] = 57
    resumed = make(*flags, loader=dataloader(prompts=100), **{**slow, "stall_passes": 1, "schedule_steps": 3})
    resumed.prompts_dataloader.load_state_dict(state)
    resumed.flat = True
    with pytest.raises(RuntimeError, match="the last 100 prompts generated"):
        resumed.generate_samples(max_len=64)
    assert resumed.rejected_in_a_row == 101


@pytest.mark.parametrize(
    "d3s",
    [
        {},  # skipping
        dict(prompt_skip="off", chunked_logits=True),  # upstream's filter alone, at fixed steps
        dict(prompt_skip="off", schedule_steps=0, sample_rule="max_var", n_init=2, n_final=2),  # upstream's loop
    ],
    ids=["skipping", "filtering", "upstream_loop"],
)
def test_upstreams_pass_rate_keeps_its_meaning_and_ours_is_the_share_of_groups_that_passed(d3s):
    """``dynamic_filtering_pass_rate`` is upstream's, as with D3S off: 100 x samples / prompts consumed (G times a
    share, with G = 5 here; skipped prompts counted in). ``d3s/filter_pass_frac`` is the share of the step's generated
    groups that passed the filter."""
    generator = make(*FILTER, **d3s)
    fracs, exhausted = [], False
    for _ in range(100):
        samples, rate, consumed, exhausted = generator.generate_samples(max_len=64)
        if samples:  # (upstream's loop ends with a call that generates nothing)
            assert rate == pytest.approx(100 * len(samples) / consumed)
            generated = consumed - generator.last_metrics.get("d3s/skipped_prompts", 0)
            fracs.append(generator.last_metrics["d3s/filter_pass_frac"])
            assert fracs[-1] == pytest.approx(len(samples) / G / generated)
        if exhausted:
            break
    assert exhausted and len(fracs) >= 3
    assert all(0 < frac <= 1 for frac in fracs) and any(frac < 1 for frac in fracs)  # the easy prompts' groups fail


def test_steps_served_from_the_sample_buffer_log_no_second_copy_of_the_counts():
    generator = make("--rollout.vllm_generate_batch_size", str(2 * B), *FILTER)
    first, second = run(generator, steps=2)
    assert first[3]["d3s/generated_tokens"] > 0 and "d3s/filter_pass_frac" in first[3]
    assert second[3]["d3s/generated_tokens"] == 0 and second[3]["d3s/skip_candidates"] == 0  # served from the buffer
    assert "d3s/filter_pass_frac" not in second[3]  # no group decided in the step


def test_the_state_grows_with_the_skip_candidates_only():
    small = make()
    large = make(loader=dataloader(prompts=2000))
    run(small, steps=6)
    run(large, steps=6)
    small_state, large_state = (g.prompts_dataloader.state_dict()[STATE_KEY] for g in (small, large))
    assert set(small_state) == set(large_state)
    # both drew the first 24 prompts (6 x B, one pass): the history holds the easy ones, none of the others
    flat = {prompt_key(f"p{i}", f"l{i}") for i in range(PROMPTS) if easy(f"p{i}")}
    assert set(small_state["history"]["streaks"]) == set(large_state["history"]["streaks"]) == flat
    del small_state["history"], large_state["history"]
    assert len(repr(large_state)) < 2 * len(repr(small_state)) + 500  # no list of skipped prompts


@pytest.mark.parametrize("save_steps", [-1, 3, 10])  # no regular checkpoints; one at step 3; a best one in between
def test_the_state_of_any_step_resumes_its_history_also_after_the_generator_ran_ahead(save_steps):
    """Upstream saves the dataloader state at ``--ckpt.save_steps`` and with every new best evaluation (any step,
    also with ``--ckpt.save_steps -1``); in async mode the generator has served batches ahead of the trainer that
    saves it. The state that went with batch 3, loaded once the generator has served the rest, resumes batch 3's
    history and draws."""
    uninterrupted = make("--ckpt.save_steps", str(save_steps))
    run(uninterrupted, steps=3)
    state, history = uninterrupted.prompts_dataloader.state_dict(), uninterrupted.policy.state_dict()
    assert history["streaks"]  # batch 3 has skip candidates to restore
    rest = run(uninterrupted)  # the generator runs ahead to the end
    resumed = make("--ckpt.save_steps", str(save_steps))
    resumed.prompts_dataloader.load_state_dict(state)
    assert resumed.policy.state_dict() == history
    assert [step[:3] for step in run(resumed)] == [step[:3] for step in rest]
    assert len(rest) == 12 - 3


# ── the random draws: independent of the selection's and of the order in which requests complete ──


def test_skip_decisions_do_not_read_the_selections_tie_break_draws():
    generator = make(skip_base=0.5, schedule_steps=1000)
    for i in range(PROMPTS):  # every prompt a candidate, skipped with probability 1 - 0.5 at every draw
        generator.policy.observe(prompt_key(f"p{i}", f"l{i}"), [1.0, 1.0])
    history = generator.policy.state_dict()
    agree = draws = position = 0
    for batch in range(48):
        generator.policy.load_state_dict(history)
        generator.batches, generator.dispatched = batch, []
        ((_, _, consumed, _),) = run(generator, steps=1)
        read = [f"p{(position + i) % PROMPTS}" for i in range(consumed)]  # the stream reads the prompts in order
        position += consumed
        skipped = [prompt not in {p for p, _ in generator.dispatched} for prompt in read]
        selection = step_generator(generator.d3s.seed, batch)  # the tie-breaks of the step with the same index
        ties = [float(torch.rand((), generator=selection, dtype=torch.float64)) < 0.5 for _ in read]
        agree += sum(s == t for s, t in zip(skipped, ties))
        draws += len(read)
    assert draws > 200 and agree / draws < 0.7  # independent streams agree half the time; one stream, always


COMPLETION_ORDERS = ("oldest first", "newest first", "shuffled")


@pytest.fixture
def completion_order(monkeypatch):
    """Make requests complete in the given order: ray.wait hands back the oldest, the newest or a random one of the
    requests in flight (the fake engine's refs are all ready)."""

    def use(order, seed=0):
        pick = {"oldest first": lambda refs: refs[0], "newest first": lambda refs: refs[-1]}
        pick["shuffled"] = random.Random(seed).choice

        def wait(refs, **_):
            ready = pick[order](list(refs))
            return [ready], [ref for ref in refs if ref is not ready]

        monkeypatch.setattr(ray, "wait", wait)

    return use


SKIP_AND_FILTER = dict(skip_base=0.5, skip_floor=0.3)


def test_what_a_batch_draws_and_skips_does_not_depend_on_the_order_requests_complete(completion_order):
    """Skipping with upstream's filter: a filtered group's replacement is the stream's next prompt whenever the group
    returns, and skip decisions are keyed by the draw, so every order draws, skips and trains the same prompts."""
    runs = []
    for order in COMPLETION_ORDERS:
        completion_order(order)
        generator = make(*FILTER, **SKIP_AND_FILTER)
        steps = run(generator)
        runs.append(([step[:3] for step in steps], generator.dispatched, generator.policy.state_dict()))
    assert sum(step[3]["d3s/skipped_prompts"] for step in steps) > 0
    assert runs[1:] == [runs[0]] * 2


def test_a_resumed_run_draws_as_the_uninterrupted_one_whatever_the_order_requests_complete(completion_order):
    completion_order("shuffled", seed=0)
    uninterrupted = make(*FILTER, **SKIP_AND_FILTER)
    run(uninterrupted, steps=4)
    state = uninterrupted.prompts_dataloader.state_dict()
    rest = run(uninterrupted)
    completion_order("shuffled", seed=1)  # a resumed run's requests complete in their own order
    resumed = make(*FILTER, **SKIP_AND_FILTER)
    resumed.prompts_dataloader.load_state_dict(state)
    assert [step[:3] for step in run(resumed)] == [step[:3] for step in rest]
    assert resumed.policy.state_dict() == uninterrupted.policy.state_dict()


def test_a_prompt_drawn_twice_in_a_batch_draws_twice_reproducibly():
    loader = dataloader(prompts=1)  # every draw is the same prompt
    stream = PromptStream(iter(loader), loader, seed=3)
    stream.start_batch(7)
    keys = [stream.next_item()[1] for _ in range(5)]
    assert keys == [(prompt_key("p0", "l0"), occurrence) for occurrence in range(5)]
    uniforms = [stream.uniform("skip", key) for key in keys]
    assert len(set(uniforms)) == 5 and uniforms != [stream.uniform("another", key) for key in keys]
    stream.start_batch(8)  # the next batch counts afresh, with draws of its own
    assert stream.next_item()[1] == keys[0] and stream.uniform("skip", keys[0]) not in uniforms
    again = PromptStream(iter(loader), loader, seed=3)
    again.start_batch(7)
    assert [again.uniform("skip", again.next_item()[1]) for _ in range(5)] == uniforms


def test_a_checkpoint_without_a_history_is_refused_when_skipping_is_on():
    generator = make(*FILTER, prompt_skip="off", chunked_logits=True)
    run(generator, steps=2)
    state = generator.prompts_dataloader.state_dict()
    with pytest.raises(ValueError, match="step 2 .* holds no prompt history .*--d3s.prompt_skip off"):
        make().prompts_dataloader.load_state_dict(state)


def screening_checkpoint(history):
    """A checkpoint of step 3 as d3s-openrlhf wrote it with the removed screening (--d3s.pilot_rollouts 2): its
    acceptance estimate, its screening counts, and the prompt of a pilot that passed after batch 3 was full (carried)
    ahead of the prompts read but not yet dispatched."""
    loader = dataloader()
    iterator = iter(loader)
    for _ in range(15):  # batches 1-3 read p0-p14: p13's pilot carried, p14 read but not yet dispatched
        next(iterator)
    carried, read = ["src", "p13", "l13", None], ["src", "p14", "l14", None]
    counts = {"d3s/pilots": 5.0, "d3s/screened_prompts": 2.0, "d3s/carried_pilots": 1.0, "d3s/generated_tokens": 42.0}
    state = {
        "batches": 3,
        "steps_served": 3,
        "passes": 0,
        "rejected_in_a_row": 0,
        "pending": [carried, read],
        "acceptance": {"accepted": 7.75, "pilots": 15.0},
        "unlogged": {"d3s/pilots": 2.0, "d3s/false_rejects": 1.0, "d3s/generated_tokens": 8.0},
        "metrics": {**counts, "d3s/pilot_acceptance": 0.6, "d3s/passes": 1.0},
        "history": history,
    }
    return {**loader.state_dict(), STATE_KEY: state}


@pytest.mark.parametrize(
    "flags, d3s", [((), {}), (FILTER, dict(prompt_skip="off", chunked_logits=True))], ids=["skipping", "filtering"]
)
def test_a_checkpoint_written_with_screening_resumes_without_it(flags, d3s):
    """The resumed run trains the rest of the fixed steps from the checkpoint's position: the carried pilot's prompt
    first, generated whole; the estimate and the screening counts are dropped, the history (if skipping) kept."""
    history = {"base": 0.3, "streaks": {prompt_key("p0", "l0"): 2, prompt_key("p2", "l2"): 1}}
    resumed = make(*flags, **d3s)
    resumed.prompts_dataloader.load_state_dict(screening_checkpoint(history))
    if resumed.policy is not None:
        assert resumed.policy.state_dict() == history
    steps = run(resumed, steps=1)
    first_batch = len(resumed.dispatched)
    steps += run(resumed)
    assert len(steps) == 12 - 3 and all(len(prompts) == B for prompts, *_ in steps)
    assert resumed.dispatched[:3] == [("p13", G), ("p14", G), ("p15", G)]
    expected = {"d3s/generated_tokens", "d3s/passes"}
    expected |= {"d3s/filter_pass_frac"} if flags else {"d3s/skipped_prompts", "d3s/skip_candidates", "d3s/skip_base"}
    assert all(set(metrics) == expected for *_, metrics in steps)
    # the unlogged count of this run's own metric goes to the first step (2 tokens a rollout)
    assert steps[0][3]["d3s/generated_tokens"] == 8 + 2 * G * first_batch
    assert "acceptance" not in resumed.prompts_dataloader.state_dict()[STATE_KEY]


def test_a_checkpoint_at_fixed_steps_is_refused_by_a_run_without_them():
    """A checkpoint of a run at fixed steps (here one screened by pilots: no skipping, no filtering) resumed by a run
    without them would train upstream's passes from the checkpoint's place in its cycle instead of the rest of its
    steps: refused, with the flags that resume it at fixed steps."""
    passes_run = make(prompt_skip="off", schedule_steps=0, sample_rule="max_var", n_init=2, n_final=2)
    with pytest.raises(ValueError, match="step 3 .*--d3s.pilot_rollouts.*--d3s.schedule_steps S"):
        passes_run.prompts_dataloader.load_state_dict(screening_checkpoint(history=None))
    assert passes_run.steps_served == 0 and passes_run.batches == 0  # nothing half-restored


def test_a_missing_reward_is_a_clear_error():
    generator = make()
    generator.rewarded = False
    with pytest.raises(RuntimeError, match=r"no reward for a rollout of prompt 'p\d+'.*--reward.remote_url"):
        generator.generate_samples(max_len=64)


def test_the_history_compares_rewards_as_the_experiences_store_them():
    """Upstream stores a rollout's reward as torch.tensor([reward]): fp32 from a Python float. Two rewards equal
    there are equal to the history too, so the history and the experience maker see one tie."""
    config = D3SConfig.from_flags(dict(preset="grpo", prompt_skip="history", schedule_steps=4))
    values = (0.1, 0.1 + 1e-12, torch.tensor(0.1, dtype=torch.float64), torch.tensor([0.25]))
    assert [_reward({"reward": value}, config) for value in values] == [torch.tensor([v]).item() for v in values]
    assert _reward({"reward": values[0]}, config) == _reward({"reward": values[1]}, config)


def test_evaluation_is_neither_skipped_nor_recorded():
    generator = make()
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
