"""The generation level inside OpenRLHF's real ``SamplesGenerator`` (``integration.samples_generator``): skipping,
screening by pilots, fixed steps, state.

Upstream's ``generate_samples`` / ``_generate_vllm`` run as shipped (Ray refs, ``ray.wait``, dynamic filtering,
the sample buffer), over a stateful prompt dataloader like upstream's; only the vLLM call is replaced by refs to
ready-made responses whose rewards depend on the prompt: "easy" prompts are always solved (every group and pilot
has zero variance), the others get alternating rewards (every pilot of 2 or more has variance).
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import ray
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from d3s_openrlhf.core.config import D3SConfig
from d3s_openrlhf.core.selection import step_generator
from d3s_openrlhf.integration.host import config_namespace, parse_host_args
from d3s_openrlhf.integration.samples_generator import (
    STATE_KEY,
    D3SSamplesGenerator,
    PromptStream,
    _reward,
    prompt_key,
)

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


# a group joins only with variance: by its pilot under screening, by upstream's range (0, 1) under filtering
FILLS_WITH_VARIANCE = [((), dict(prompt_skip="off", pilot_rollouts=K)), (("--algo.dynamic_filtering_enable",), {})]


@pytest.mark.parametrize("flags, d3s", FILLS_WITH_VARIANCE, ids=["screening", "filtering"])
@pytest.mark.parametrize("stall_passes", [1, 4])
def test_a_run_that_can_never_fill_stops_after_the_stall_passes(flags, d3s, stall_passes):
    """At 0% acceptance: stopped once --d3s.stall_passes passes over the prompts went by without a group joining,
    with the flags to change; not before."""
    generator = make(*flags, stall_passes=stall_passes, **d3s)
    generator.flat = True
    message = f"the last {stall_passes * PROMPTS} prompts generated .*--d3s.stall_passes.* none joined a batch"
    with pytest.raises(RuntimeError, match=message):
        generator.generate_samples(max_len=64)
    assert generator.rejected_in_a_row == stall_passes * PROMPTS + 1


@pytest.mark.parametrize("flags, d3s", FILLS_WITH_VARIANCE, ids=["screening", "filtering"])
def test_a_run_that_fills_slowly_goes_on_however_many_passes_a_batch_takes(flags, d3s):
    """At 1% acceptance (one prompt in 100 has variance) a batch of 8 groups takes 8 passes over the prompts, beyond
    any per-batch allowance, and the run goes on: a group joins every pass, within --d3s.stall_passes 2."""
    slow = dict(stall_passes=2, schedule_steps=2, **d3s)
    generator = make(*flags, "--rollout.batch_size", "8", loader=dataloader(prompts=100), **slow)
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
    """Upstream divides samples by prompts consumed (G times the share, with G = 5 here; skipped prompts counted);
    logged is the share of the step's generated prompts whose group joined the batch. Under screening, the
    prompts decided in the step: a pilot carried from the batch before counts where its group joins."""
    generator = make(*FILTER, **d3s)
    rates, carried = [], 0
    while True:
        samples, rate, consumed, exhausted = generator.generate_samples(max_len=64)
        metrics = generator.last_metrics
        if samples:  # (upstream's loop ends with a call that generates nothing)
            groups = len(samples) // G
            if "pilot_rollouts" in d3s:
                decided = groups + metrics["d3s/screened_prompts"] + metrics["d3s/filtered_prompts"]
                carried += metrics["d3s/carried_pilots"]
            else:
                decided = consumed - metrics.get("d3s/skipped_prompts", 0)  # the prompts skipped were not generated
            rates.append((rate, 100 * groups / decided))
        if exhausted:
            break
    for rate, share in rates:
        assert rate == pytest.approx(share) and 0 < rate <= 100
    assert any(rate < 100 for rate, _ in rates)  # the mixed prompts' groups pass the range, the easy ones not
    assert carried or "pilot_rollouts" not in d3s  # the screened run carried pilots into later batches


def test_a_batch_filled_by_carried_pilots_logs_its_pass_rate():
    """A batch that the pilots carried from the last one fill consumes no new prompt, so upstream's rate is None
    (it divides by prompts consumed); the prompts decided in the step are those carried groups, all joined: 100%.
    (The test above meets such a batch only when the pilots happen to return in that order.)"""
    generator = make(*FILTER, prompt_skip="off", pilot_rollouts=K)
    for i in range(1, 2 * B, 2):  # B mixed prompts whose pilots passed after the last batch was full
        generator._carried.append((("src", f"p{i}", f"l{i}", None), responses(f"p{i}", f"l{i}", K)))
    samples, rate, consumed, _ = generator.generate_samples(max_len=64)
    assert len(samples) == B * G and consumed == 0 and not generator._carried
    assert rate == 100.0 and generator.last_metrics["d3s/pilots"] == 0


def test_steps_served_from_the_sample_buffer_log_no_second_copy_of_the_counts():
    generator = make("--rollout.vllm_generate_batch_size", str(2 * B), prompt_skip="off", pilot_rollouts=K)
    first, second = run(generator, steps=2)
    assert first[3]["d3s/pilots"] > 0 and first[3]["d3s/generated_tokens"] > 0
    assert second[3]["d3s/pilots"] == 0 and second[3]["d3s/generated_tokens"] == 0  # served from the buffer


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


def record_decisions(generator):
    """Spy on a generator's skip and audit decisions: {(stream, batch, prompt): [[input, decision], ...]}, the input
    being the skip probability (rounded) or None for the audit (of an easy prompt's pilot, always flat)."""
    decisions = defaultdict(list)
    policy, skips, dispatch = generator.policy, generator.policy.skips, generator._dispatch_prompts_to_vllm

    def spy_skips(key, uniform):
        skipped = skips(key, uniform)
        decisions["skip", generator.batches, key].append([round(policy.skip_probability(key), 9), skipped])
        return skipped

    def spy_dispatch(prompts, labels, **kwargs):
        for prompt, label in zip(prompts, labels):
            if easy(prompt) and kwargs["n_samples_per_prompt"] == K:
                decisions["audit", generator.batches, prompt_key(prompt, label)].append([None, False])
            elif easy(prompt):  # the rest of a screened pilot: it was audited
                decisions["audit", generator.batches, prompt_key(prompt, label)][-1][1] = True
        return dispatch(prompts, labels, **kwargs)

    policy.skips, generator._dispatch_prompts_to_vllm = spy_skips, spy_dispatch
    return decisions


def compare(first, second, stream):
    """(shared, differing): the decisions of ``stream`` two runs took on the same draw (batch, prompt) with the same
    input."""
    shared = differing = 0
    for draw in first.keys() & second.keys():
        if draw[0] != stream:
            continue
        for (input_a, decision_a), (input_b, decision_b) in zip(first[draw], second[draw]):
            if input_a == input_b:
                shared += 1
                differing += decision_a != decision_b
    return shared, differing


COMPLETION_ORDERS = ("oldest first", "newest first", "shuffled")


@pytest.fixture
def completion_order(monkeypatch):
    """Make requests complete in the given order: ray.wait hands back the oldest, the newest or a random one of the
    requests in flight (the fake engine's refs are all ready)."""

    def use(order, seed=0):
        pick = {"oldest first": lambda refs: refs[0], "newest first": lambda refs: refs[-1]}
        pick["shuffled"] = random.Random(seed).choice
        monkeypatch.setattr(ray, "wait", lambda refs, **_: ([pick[order](list(refs))], None))

    return use


SCREENED = dict(pilot_rollouts=K, pilot_audit=0.5, skip_base=0.5, skip_floor=0.3)


def test_skip_and_audit_decisions_do_not_depend_on_the_order_pilots_complete(completion_order):
    runs = {}
    for order in (*COMPLETION_ORDERS, "rerun"):
        completion_order("oldest first" if order == "rerun" else order)
        generator = make(**SCREENED)
        decisions = record_decisions(generator)
        run(generator)
        runs[order] = (decisions, generator.dispatched)
    reference, dispatched = runs["oldest first"]
    assert runs["rerun"] == (reference, dispatched)  # the same order: the same run
    for order in ("newest first", "shuffled"):
        assert runs[order][1] != dispatched  # the order changed which prompts the batches drew
        for stream in ("skip", "audit"):
            shared, differing = compare(reference, runs[order][0], stream)
            assert shared >= 10 and differing == 0, (order, stream, shared, differing)


def test_a_resumed_screened_run_decides_as_the_uninterrupted_one(completion_order):
    completion_order("shuffled", seed=0)
    uninterrupted = make(**SCREENED)
    run(uninterrupted, steps=4)
    state = uninterrupted.prompts_dataloader.state_dict()
    before = record_decisions(uninterrupted)
    run(uninterrupted)
    completion_order("shuffled", seed=1)  # a resumed run's requests complete in their own order
    resumed = make(**SCREENED)
    resumed.prompts_dataloader.load_state_dict(state)
    after = record_decisions(resumed)
    run(resumed)
    for stream in ("skip", "audit"):
        shared, differing = compare(before, after, stream)
        assert shared >= 5 and differing == 0, (stream, shared, differing)


def test_a_prompt_drawn_twice_in_a_batch_draws_twice_reproducibly():
    loader = dataloader(prompts=1)  # every draw is the same prompt
    stream = PromptStream(iter(loader), loader, seed=3)
    stream.start_batch(7)
    keys = [stream.next_item()[1] for _ in range(5)]
    assert keys == [(prompt_key("p0", "l0"), occurrence) for occurrence in range(5)]
    uniforms = [stream.uniform("audit", key) for key in keys]
    assert len(set(uniforms)) == 5 and uniforms != [stream.uniform("skip", key) for key in keys]
    stream.start_batch(8)  # the next batch counts afresh, with draws of its own
    assert stream.next_item()[1] == keys[0] and stream.uniform("audit", keys[0]) not in uniforms
    again = PromptStream(iter(loader), loader, seed=3)
    again.start_batch(7)
    assert [again.uniform("audit", again.next_item()[1]) for _ in range(5)] == uniforms


def test_a_checkpoint_without_a_history_is_refused_when_skipping_is_on():
    generator = make(prompt_skip="off", pilot_rollouts=K)
    run(generator, steps=2)
    state = generator.prompts_dataloader.state_dict()
    with pytest.raises(ValueError, match="step 2 .* holds no prompt history .*--d3s.prompt_skip off"):
        make(pilot_rollouts=K).prompts_dataloader.load_state_dict(state)


@pytest.mark.parametrize("screen", [0, K])
def test_a_missing_reward_is_a_clear_error(screen):
    generator = make(pilot_rollouts=screen)
    generator.rewarded = False
    with pytest.raises(RuntimeError, match=r"no reward for a rollout of prompt 'p\d+'.*--reward.remote_url"):
        generator.generate_samples(max_len=64)


def test_the_screen_compares_rewards_as_the_experiences_store_them():
    """Upstream stores a rollout's reward as torch.tensor([reward]): fp32 from a Python float. Two rewards equal
    there are equal to the screen too, so the screen and the experience maker's screening weights see one tie."""
    config = D3SConfig.from_flags(dict(preset="grpo", pilot_rollouts=K, schedule_steps=4))
    values = (0.1, 0.1 + 1e-12, torch.tensor(0.1, dtype=torch.float64), torch.tensor([0.25]))
    assert [_reward({"reward": value}, config) for value in values] == [torch.tensor([v]).item() for v in values]
    assert _reward({"reward": values[0]}, config) == _reward({"reward": values[1]}, config)


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
