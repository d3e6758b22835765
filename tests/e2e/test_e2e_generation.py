"""The generation level (``--d3s.prompt_skip history``, fixed steps) in real ``train_ppo_ray`` runs on the CPU
runtime, over a toy task in which a known half of the prompts is always solved: the reward file gives every rollout
of an "easy" prompt (operands with an even sum) reward 1 and scores the others by exact match, and logs each scored
rollout so that the test can count what was generated.

A resume from the best checkpoint of an evaluation that restores the position and the history (sync with D3S over
several passes, async with GRPO; tests/e2e/test_e2e_dead_actor.py resumes from a regular checkpoint), async with
dynamic filtering, and a run that can never fill a batch (a reward that never varies under upstream's filter) stops
with the stall rule's message. The reward always comes at generation time (``--reward.remote_url`` with a reward
file)."""

import dataclasses
import json
from pathlib import Path

import pytest

from d3s_openrlhf.testbed import pipeline

pytestmark = pytest.mark.e2e

PROMPTS, GROUP, STEPS = 16, 8, 10  # 10 steps of 4 prompts: 2.5 passes at the least
BASE = pipeline.RLConfig(
    prompts_per_step=4, samples_per_prompt=GROUP, steps=PROMPTS // 4, train_batch_size=8, micro_batch_size=8
)
# the entropy bonus keeps every optimizer window's gradient non-zero (upstream logs the last window's norm), also
# one whose rollouts have no kept token or equal rewards
ENTROPY = ["--actor.entropy_coef", "0.01"]
SKIP = ["--d3s.prompt_skip", "history"]

REWARD = """
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
"""


def grpo(steps=STEPS):
    return ["--d3s.preset", "grpo", "--d3s.schedule_steps", str(steps), *ENTROPY]


def d3s(steps=STEPS):
    return ["--d3s.preset", "d3s", "--d3s.n_init", "4", "--d3s.n_final", "8", *grpo(steps)[2:]]


def ppo_args(toy_sft, tmp_path, name, config):
    return pipeline.ppo_args(toy_sft.sft_model, toy_sft.task, str(tmp_path / name), config)


def reward_file(tmp_path, name, mixed="float(response == str(label).strip())"):
    log = tmp_path / f"{name}_scored.txt"
    path = tmp_path / f"{name}_reward.py"
    path.write_text(REWARD.format(mixed=mixed, log=str(log)))
    return str(path), log


def scored(log):
    """({prompt: rollouts scored}, the easy prompts) from the reward file's log."""
    counts, easy = {}, set()
    for flag, prompt in (line.split(" ", 1) for line in log.read_text().splitlines()):
        counts[prompt] = counts.get(prompt, 0) + 1
        if flag == "1":
            easy.add(prompt)
    return counts, easy


def assert_generation_run(run, assert_clean_run, steps=STEPS, first=1):
    """Exactly the fixed steps, each a full batch of full groups."""
    assert_clean_run(run, range(first, steps + 1))
    for step, values in run.steps.items():
        assert values["rollout/num_samples"] == 4 * GROUP, (step, values["rollout/num_samples"])
        assert values["d3s/generated_tokens"] >= 4 * GROUP, step


def test_async_with_dynamic_filtering(toy_sft, run_pipeline, assert_clean_run, tmp_path):
    """Skipping and upstream's filter at once, in async mode: the filter's range drops the flat groups."""
    reward, log = reward_file(tmp_path, "async")
    filtering = ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.05", "0.95"]
    extra = grpo() + SKIP + filtering + ["--train.async_enable"]
    config = dataclasses.replace(BASE, reward=reward, extra=extra)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "async", config), name="async")
    assert_generation_run(run, assert_clean_run)
    counts, _ = scored(log)
    assert all(count % GROUP == 0 for count in counts.values()), counts
    for step, values in run.steps.items():
        assert 0 < values["d3s/filter_pass_frac"] <= 1, step
        assert values["d3s/zero_var_groups"] == 0, step  # the filter's range drops the flat groups


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_resumes_from_its_best_checkpoint_with_the_history(
    toy_sft, run_pipeline, assert_clean_run, tmp_path, mode
):
    """No regular checkpoints (``--ckpt.save_steps -1``), an evaluation at step 4 whose best checkpoint is the one
    the run resumes: it trains the rest of the fixed steps (not a new count), and its first batch, in the second
    pass, already skips, which a fresh history (no candidates) could not. Async (GRPO): the evaluation at step 4 runs
    while the trainer takes batch 5, whose state the best checkpoint saves (upstream). Sync trains D3S beside the
    skipping, and over both runs every prompt is generated whole or skipped, for several passes over the prompts."""
    reward, log = reward_file(tmp_path, "best", mixed="0.0")  # every prompt's group flat: easy 1, others 0
    evaluation = ["--eval.dataset", toy_sft.task.heldout, "--eval.steps", "4", "--eval.n_samples_per_prompt", "2"]
    checkpoint = ["--ckpt.save_steps", "-1", "--ckpt.path", str(tmp_path / "checkpoints")]
    asynchronous = ["--train.async_enable"] if mode == "async" else []
    flags = SKIP + ["--d3s.skip_base", "0.05"] + evaluation + checkpoint + asynchronous
    level = d3s if mode == "sync" else grpo
    first = dataclasses.replace(BASE, reward=reward, extra=level(6) + flags)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "first", first), name="first")
    assert_generation_run(run, assert_clean_run, steps=6)
    # a skip needs an earlier observation of the prompt: in the first batch only once its draws reached pass 2
    assert run.steps[1]["d3s/skipped_prompts"] == 0 or run.steps[1]["d3s/passes"] >= 2
    saved = sorted(path.name for path in (tmp_path / "checkpoints" / "_actor").iterdir() if path.is_dir())
    assert saved == ["best_global_step4"], saved
    resumed = dataclasses.replace(first, extra=level() + flags + ["--ckpt.load_enable"])
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, "resumed", resumed), name="resumed")
    start = 5 if mode == "sync" else 6
    assert_generation_run(run, assert_clean_run, first=start)
    # all 16 prompts were seen, each with a flat group: candidates, skipped with probability 0.95
    assert run.steps[start]["d3s/skip_candidates"] >= 4 and run.steps[start]["d3s/skipped_prompts"] > 0, run.tail()
    heldout = {json.loads(line)["input"] for line in Path(toy_sft.task.heldout).read_text().splitlines()}
    counts, easy = scored(log)
    counts = {prompt: count for prompt, count in counts.items() if prompt not in heldout}  # the evaluation's too
    assert len(counts) == PROMPTS and 0 < len(easy - heldout) < PROMPTS
    assert all(count % GROUP == 0 for count in counts.values()), counts  # a prompt is generated whole or skipped
    assert run.steps[STEPS]["d3s/passes"] >= 3


def test_a_run_that_can_never_fill_stops_with_the_flags_to_change(toy_sft, run_pipeline, tmp_path):
    """A reward that never varies within a prompt (1 for an easy prompt, 0 for the others): every group falls outside
    upstream's dynamic filtering range, so no batch can fill. The real pipeline must stop, not generate for ever: the
    samples generator's stall rule raises once --d3s.stall_passes passes over the prompts went by without a group
    joining, the error reaches the launcher's exit code and log with the flags to change, and no process outlives
    the run."""
    name = "filtering"
    reward, log = reward_file(tmp_path, name, mixed="0.0")
    level = ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.05", "0.95"]
    config = dataclasses.replace(BASE, reward=reward, extra=d3s() + level + ["--d3s.stall_passes", "1"])
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, ppo_args(toy_sft, tmp_path, name, config), name=name)
    assert isinstance(run.returncode, int) and run.returncode != 0, f"exit {run.returncode}\n{run.tail()}"
    text = Path(run.log).read_text()
    assert f"the last {PROMPTS} prompts generated (1 passes over the prompts, --d3s.stall_passes)" in text, run.tail()
    assert "--algo.dynamic_filtering_range" in text and not run.steps  # the message names the flags; no step trained
    assert not run.leftovers, f"processes outlived the run: {run.leftovers}"
    counts, _ = scored(log)
    assert len(counts) == PROMPTS  # every prompt generated in the one pass the rule allows
