"""Prompt skipping before generation (``--d3s.prompt_skip history``) in real ``train_ppo_ray`` runs on the CPU
runtime, over several epochs of a toy task in which a known half of the prompts is always solved: the reward file
gives every rollout of an "easy" prompt (operands with an even sum) reward 1 and scores the others by exact match,
and logs each scored prompt so that the test can count what was generated."""

import dataclasses
import re

import pytest

from d3s_openrlhf.testbed import pipeline

pytestmark = pytest.mark.e2e

PROMPTS, GROUP, EPOCHS = 16, 8, 4
# 4 prompts a step; kept counts in units of one prompt's group, so an epoch's short last batch stays legal
BASE = pipeline.RLConfig(
    prompts_per_step=4, samples_per_prompt=GROUP, steps=PROMPTS // 4, episodes=EPOCHS, train_batch_size=8,
    micro_batch_size=8,
)  # fmt: skip
# the entropy bonus keeps every step's gradient non-zero, also a step whose groups all have equal rewards
SKIP = ["--d3s.preset", "grpo", "--d3s.prompt_skip", "history", "--d3s.skip_init_prob", "0.9", "--actor.entropy_coef", "0.01"]  # fmt: skip

REWARD = '''
import re, torch

def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        a, b = map(int, re.search(r"(\\d+)\\+(\\d+)=", prompt).groups())
        response = query[query.find(prompt) + len(prompt):].split("</s>", 1)[0]
        easy = (a + b) % 2 == 0
        rewards.append(1.0 if easy else {mixed})
        with open({log!r}, "a") as log:
            log.write(f"{{int(easy)}} {{prompt}}\\n")
    rewards = torch.tensor(rewards)
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{}}}}
'''


def ppo_args(toy_sft, tmp_path, name, config):
    return pipeline.ppo_args(toy_sft.sft_model, toy_sft.task, str(tmp_path / name), config)


def reward_file(tmp_path, name, mixed="float(response == str(label).strip())"):
    log = tmp_path / f"{name}_scored.txt"
    path = tmp_path / f"{name}_reward.py"
    path.write_text(REWARD.format(mixed=mixed, log=str(log)))
    return str(path), log


def generated_groups(log):
    """{prompt: groups generated} and which prompts are easy, from the reward file's log (G lines a group)."""
    lines = [line.split(" ", 1) for line in log.read_text().splitlines()]
    counts, easy = {}, set()
    for flag, prompt in lines:
        counts[prompt] = counts.get(prompt, 0) + 1
        if flag == "1":
            easy.add(prompt)
    assert all(count % GROUP == 0 for count in counts.values()), counts
    return {prompt: count // GROUP for prompt, count in counts.items()}, easy


def assert_skipping_run(run, assert_clean_run):
    taken = len(run.steps)
    assert_clean_run(run, range(1, taken + 1))
    for step, values in run.steps.items():
        generated = values["rollout/num_samples"]
        assert generated % GROUP == 0 and generated <= 4 * GROUP, (step, generated)  # whole groups, B at most
        assert values["d3s/kept_rollouts"] == generated, step  # no sample selection: every rollout trained
        assert 0 <= values["d3s/skip_prob"] <= 0.9 and values["d3s/skipped_prompts"] <= values["d3s/skip_candidates"]
        assert values["d3s/generated_tokens"] >= generated, step
    return taken


def test_easy_prompts_are_skipped_after_the_first_epoch(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    reward, log = reward_file(tmp_path, "skip")
    config = dataclasses.replace(BASE, reward=reward, extra=SKIP)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "skip", config), name="skip")
    taken = assert_skipping_run(run, assert_clean_run)
    groups, easy = generated_groups(log)
    assert len(groups) == PROMPTS and 0 < len(easy) < PROMPTS
    # every prompt is generated in the first epoch; afterwards most visits to an easy prompt are skipped
    easy_later = sum(groups[prompt] - 1 for prompt in easy)
    assert easy_later <= 0.5 * (EPOCHS - 1) * len(easy), (easy_later, len(easy), run.tail())
    skipped = sum(values["d3s/skipped_prompts"] - values["d3s/refilled_prompts"] for values in run.steps.values())
    # every visit was generated or skipped, once (refilled prompts fill an epoch's last batch); skips after the
    # run's last step are counted but never logged (no step follows them): at most the last epoch's rest
    unlogged = EPOCHS * PROMPTS - sum(groups.values()) - skipped
    assert 0 <= unlogged < PROMPTS, (skipped, sum(groups.values()))
    # no short batch: every step trained a whole batch of 4 prompts
    assert all(values["rollout/num_samples"] == 4 * GROUP for values in run.steps.values())
    assert taken < EPOCHS * PROMPTS // 4  # fewer steps than the epochs of 4 full batches each
    assert run.steps[1]["d3s/skipped_prompts"] == 0  # no history before the first epoch


def test_async_with_dynamic_filtering(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """Both modes at once: filtered groups (outside (0.1, 0.9)) are replaced after generation, candidates are
    skipped before it, each prompt counted once."""
    reward, log = reward_file(tmp_path, "async")
    filtering = ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9"]
    config = dataclasses.replace(BASE, episodes=3, reward=reward, extra=SKIP + filtering + ["--train.async_enable"])
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "async", config), name="async")
    assert_skipping_run(run, assert_clean_run)
    groups, easy = generated_groups(log)
    skipped = sum(values["d3s/skipped_prompts"] for values in run.steps.values())
    refilled = sum(values["d3s/refilled_prompts"] for values in run.steps.values())
    assert skipped > 0, "no candidate was skipped before generation"
    # the filter's extra draws can reach an epoch's end, whose short batch takes skipped prompts back (refilled):
    # how many depends on the async timing; each prompt is still counted once
    assert skipped - refilled == 3 * PROMPTS - sum(groups.values()), (skipped, refilled, sum(groups.values()))
    assert all(re.match(r"\d+\+\d+=", prompt) for prompt in groups)


def test_resume_restores_the_history(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """One epoch with a checkpoint at its end, then the run resumed for a second: its first batch already skips,
    which a fresh history (no candidates) could not. Rewards depend on the prompt alone (easy 1, others 0)."""
    reward, _ = reward_file(tmp_path, "resume", mixed="0.0")
    checkpoint = ["--ckpt.save_steps", "4", "--ckpt.path", str(tmp_path / "checkpoints")]
    first = dataclasses.replace(BASE, episodes=1, reward=reward, extra=SKIP + checkpoint)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "first", first), name="first")
    assert assert_skipping_run(run, assert_clean_run) == 4
    resumed = dataclasses.replace(first, episodes=2, extra=SKIP + checkpoint + ["--ckpt.load_enable"])
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "resumed", resumed), name="resumed")
    assert min(run.steps) == 5, run.tail()
    assert_clean_run(run, range(5, max(run.steps) + 1))
    # every prompt's only group so far had equal rewards: all are candidates, at p = 0.9 most are skipped
    assert run.steps[5]["d3s/skip_candidates"] >= 4 and run.steps[5]["d3s/skipped_prompts"] > 0, run.tail()
