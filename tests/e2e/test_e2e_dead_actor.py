"""A dead actor ends the run instead of hanging it: real ``train_ppo_ray`` runs (CPU runtime) in which the vLLM
engine or, in async mode, the generator actor is killed by SIGKILL (as an OOM kill does) once step 2 is logged.
The run must exit non-zero well within 5 minutes, its last lines naming the dead actor and Ray's cause, leave no
process behind but the killed actor's orphans, and the checkpoint it wrote before must resume, the schedule going on
from the step resumed (the suite's checkpoint resume; the runs pack their samples).

At start-up (sync and async), the engine is killed while vLLM loads (an OOM at load, the most common engine death
on a GPU): policy rank 0 then waits in the weight-sync group's rendezvous and the driver on the models' loading,
which the driver's watch ends (integration/driver_watch.py) within 2 minutes, naming the engine and the phase.

Killed at that point, the engine is (or soon is) generating, so the run ends through Ray's own error on that wait.
A death during a weight sync, which nothing fails and which the trainers' watch ends (integration/liveness.py),
lasts ~0.1 s of a toy step and cannot be hit from outside reliably: tests/integration/test_integration_liveness.py
covers it with a wait that never ends on its own."""

import dataclasses
import os
import signal
import time
import uuid

import pipeline_checks as helpers
import pytest

from d3s_openrlhf.testbed import pipeline
from d3s_openrlhf.testbed.processes import command_line

pytestmark = pytest.mark.e2e

VICTIM_MARKER = "D3S_E2E_VICTIM_RUN"
# Ray's process titles: ray::<actor class>[.<method>]
VICTIMS = {"engine": "RolloutRayActor", "generator": "GenerateSamplesActor"}
DEADLINE_S = 300  # the bound; the runs here end a few seconds after the kill
STARTUP_DEADLINE_S = 120  # a ping interval (5 s) and Ray's detection, then the teardown
LOADING_LINE = "Initializing a V1 LLM engine"  # vLLM's, as the engine starts loading the model


def _descendants(pid):
    """PIDs of the processes below ``pid``."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


class Killer:
    """``on_line`` of a run: at the first line containing ``at`` (by default, logging global step 2), SIGKILLs the
    run's process whose Ray title names ``actor_class``; records when, and when the run's output last moved."""

    def __init__(self, run_processes, tag, actor_class, at="Global step 2"):
        self.run_processes, self.tag, self.actor_class, self.at = run_processes, tag, actor_class, at
        self.killed_at = self.last_line_at = None
        self.victim, self.orphans = None, []

    def __call__(self, line):
        self.last_line_at = time.monotonic()
        if self.killed_at is not None or self.at not in line:
            return
        for pid in self.run_processes.alive(self.tag, marker=VICTIM_MARKER):
            command = command_line(pid, width=None)
            if command.startswith("ray::") and self.actor_class in command.split()[0]:
                self.orphans = _descendants(pid)
                os.kill(pid, signal.SIGKILL)
                self.victim, self.killed_at = command, time.monotonic()
                return


@pytest.mark.parametrize(
    "mode, victim", [("sync", "engine"), ("async", "engine"), ("async", "generator")], ids=lambda v: v
)
def test_a_dead_actor_ends_the_run_with_its_name_and_cause(
    mode, victim, toy_sft, run_pipeline, run_processes, assert_clean_run, tmp_path
):
    # packed samples (--ds.packing_samples forces flash_attention_2: upstream's default attention, served by the CPU
    # stand-in), through the resume below too
    packing = ["--ds.packing_samples", "--ds.attn_implementation", "flash_attention_2"]
    checkpoints = ["--ckpt.save_steps", "1", "--ckpt.path", str(tmp_path / "checkpoints")]
    extra = helpers.d3s_flags(**helpers.CROSS) + packing + checkpoints
    extra += ["--train.async_enable"] if mode == "async" else []
    config = dataclasses.replace(helpers.BASE, steps=4, extra=extra)
    tag = uuid.uuid4().hex
    killer = Killer(run_processes, tag, VICTIMS[victim])
    args = pipeline.ppo_args(toy_sft.sft_model, toy_sft.task, str(tmp_path / "killed"), config)
    # the killed engine's vLLM EngineCore (and its resource tracker) lose their parent to the SIGKILL and outlive the
    # run (vLLM's own behaviour): the fixture kills them; nothing else may outlive it
    run = run_pipeline(
        pipeline.D3S_ENTRYPOINT,
        args,
        name="killed",
        env={VICTIM_MARKER: tag},
        on_line=killer,
        orphans=lambda: killer.orphans,
    )

    assert killer.killed_at is not None, f"no {VICTIMS[victim]} process to kill at step 2\n{run.tail()}"
    assert isinstance(run.returncode, int) and run.returncode != 0, f"exit {run.returncode}\n{run.tail()}"
    took = killer.last_line_at - killer.killed_at
    print(f"{mode}/{victim}: killed {killer.victim!r}; the run's output ended {took:.1f} s later")
    assert took < DEADLINE_S
    tail = run.tail(15)
    assert VICTIMS[victim] in tail and "died" in tail and "worker process has died" in tail, tail
    assert not run.leftovers, f"processes outlived the run: {run.leftovers}"
    assert 4 not in run.steps, "the run went on without its actor"

    if (mode, victim) != ("sync", "engine"):
        return  # one resume shows the checkpoint outlives the abort (the others write theirs alike)
    resumed = dataclasses.replace(config, extra=extra + ["--ckpt.load_enable"])
    args = pipeline.ppo_args(toy_sft.sft_model, toy_sft.task, str(tmp_path / "resumed"), resumed)
    run = run_pipeline(pipeline.D3S_ENTRYPOINT, args, name="resumed")
    first = min(run.steps, default=None)
    # after step 2's checkpoint, or step 1's where the abort cut step 2's short (DeepSpeed names it latest last)
    assert first in (2, 3), f"resumed at {first}\n{run.tail()}"
    assert_clean_run(run, range(first, 5))
    # the schedule goes on from the step resumed (over the run's 4 steps), with its kept counts
    helpers.assert_kept_counts(run, helpers.expected_schedule(helpers.CROSS, resumed, 4, first_step=first))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_dead_at_start_up_ends_the_run_with_its_name_and_the_phase(
    mode, toy_sft, run_pipeline, run_processes, tmp_path
):
    extra = helpers.d3s_flags(**helpers.CROSS) + (["--train.async_enable"] if mode == "async" else [])
    config = dataclasses.replace(helpers.BASE, extra=extra)
    tag = uuid.uuid4().hex
    killer = Killer(run_processes, tag, VICTIMS["engine"], at=LOADING_LINE)
    args = pipeline.ppo_args(toy_sft.sft_model, toy_sft.task, str(tmp_path / "killed"), config)
    run = run_pipeline(
        pipeline.D3S_ENTRYPOINT,
        args,
        name="killed",
        env={VICTIM_MARKER: tag},
        on_line=killer,
        orphans=lambda: killer.orphans,
    )

    assert killer.killed_at is not None, f"no {VICTIMS['engine']} process to kill at start-up\n{run.tail()}"
    assert isinstance(run.returncode, int) and run.returncode != 0, f"exit {run.returncode}\n{run.tail()}"
    took = killer.last_line_at - killer.killed_at
    print(f"{mode}: killed {killer.victim!r} at start-up; the run's output ended {took:.1f} s later")
    assert took < STARTUP_DEADLINE_S
    tail = run.tail(40)  # the teardown of the other actors may follow the error
    assert "vLLM engine 0 died during start-up" in tail and VICTIMS["engine"] in tail, tail
    assert not run.leftovers, f"processes outlived the run: {run.leftovers}"
    assert not run.steps, "the run trained without its engine"
