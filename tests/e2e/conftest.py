"""Fixtures of the end-to-end tests: real ``train_ppo_ray`` runs on the toy model, under the CPU runtime.

One SFT checkpoint of the toy model is prepared per session (``toy_sft``, tests/conftest.py); every test then
runs the real Ray pipeline as a subprocess (``python -m d3s_openrlhf.cli.cpu <module> ...``), reads the metrics
OpenRLHF logged to tensorboard and checks that no process of the run (Ray head, workers, vLLM engine) is left
once it has exited. Processes of a run are recognised by a marker in their environment, which every descendant
inherits.
"""

import math
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from d3s_openrlhf.testbed import pipeline, processes
from d3s_openrlhf.testbed.metrics import read_train_scalars
from d3s_openrlhf.testbed.processes import command_line

# the shared checks of the runs, ``import pipeline_checks`` (tests/ is no package)
sys.path.insert(0, str(Path(__file__).resolve().parent))

MARKER = "D3S_E2E_RUN"
RUN_TIMEOUT_S = 400  # a run takes 40-90 s here; a hang (e.g. a placement group without GPUs) must not stall CI


def marked_processes(run_id, marker=MARKER):
    """PIDs of live processes whose environment carries ``marker=run_id`` (``testbed.processes``)."""
    return processes.marked_processes(marker, run_id)


def leftover_processes(run_id, grace_s=45.0, orphans=()):
    """Processes of the run still alive ``grace_s`` after it exited (then killed, so that they leak no further).
    ``orphans``: PIDs expected to outlive the run (a killed actor's children); killed at once, never named."""
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.time() + grace_s
    while time.time() < deadline:
        alive = [pid for pid in marked_processes(run_id) if pid not in orphans]
        if not alive:
            return []
        time.sleep(0.5)
    names = []
    for pid in marked_processes(run_id):
        if pid in orphans:
            continue
        command = command_line(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        names.append(f"{pid}: {command}")
    return names


@pytest.fixture
def run_processes():
    """``.marker`` (the environment variable that tags a run's processes), ``.alive(run_id)`` (their PIDs) and
    ``.leftover(run_id, grace_s)`` (those still alive after the grace period, killed and named)."""
    return SimpleNamespace(marker=MARKER, alive=marked_processes, leftover=leftover_processes)


@dataclass
class Run:
    returncode: object  # int, or a text when the run was killed after the timeout
    log: str
    steps: dict  # {global_step: {metric: value}}
    leftovers: list

    def tail(self, lines=60):
        with open(self.log) as f:
            return "".join(f.readlines()[-lines:])


@pytest.fixture
def run_pipeline(tmp_path):
    """``run_pipeline(module, args, name=..., env_flag=False, env=None, on_line=None, orphans=None) -> Run``: one
    run, its metrics, leftover processes.

    The run goes through the launcher (``python -m d3s_openrlhf.cli.cpu module ...``), or with ``env_flag`` through
    ``D3S_OPENRLHF_CPU=1 python -m module ...`` (the module then activates the runtime itself). ``env`` adds
    environment variables (a ``RAY_ADDRESS`` joins that cluster); ``on_line`` is called with each line of the run's
    output as it comes; ``orphans()``, asked once the run has exited, gives the PIDs expected to outlive it
    (``leftover_processes``).
    """

    def run(module, args, name="run", env_flag=False, env=None, on_line=None, orphans=None):
        run_id = uuid.uuid4().hex
        given = env or {}
        env = dict(os.environ, **{MARKER: run_id})
        env.pop("RAY_ADDRESS", None)  # a run starts its own Ray head, unless ``env`` names a cluster
        env.update(given)
        if env_flag:
            env["D3S_OPENRLHF_CPU"] = "1"
            command = [sys.executable, "-m", module, *[str(a) for a in args]]
        else:
            env.pop("D3S_OPENRLHF_CPU", None)
            command = pipeline.launcher_command(module, args)
        log = str(tmp_path / f"{name}.log")
        try:
            rc = pipeline.run_logged(command, log, on_line=on_line, env=env, timeout=RUN_TIMEOUT_S)
        except TimeoutError:
            rc = f"none: killed after {RUN_TIMEOUT_S}s"
        leftovers = leftover_processes(run_id, orphans=orphans() if orphans else ())
        return Run(rc, log, read_train_scalars(str(tmp_path / name / "tensorboard")), leftovers)

    return run


def _assert_clean_run(run, expected_steps, grad_every_step=True):
    assert run.returncode == 0, f"exit {run.returncode}\n{run.tail()}"
    assert not run.leftovers, f"processes outlived the run: {run.leftovers}"
    assert list(run.steps) == list(expected_steps), f"logged steps {list(run.steps)}\n{run.tail()}"
    for step, values in run.steps.items():
        assert math.isfinite(values["policy_loss"]), (step, values["policy_loss"])
        if grad_every_step:
            assert values["actor_grad_norm"] > 0, (step, values["actor_grad_norm"])
    grads = {step: values["actor_grad_norm"] for step, values in run.steps.items()}
    assert any(grad > 0 for grad in grads.values()), grads


@pytest.fixture
def assert_clean_run():
    """``assert_clean_run(run, steps, grad_every_step=True)``: exit 0, no process left, exactly these steps logged,
    finite loss at every step, a non-zero gradient norm at every step (at some step, if ``grad_every_step`` is
    False). The norm upstream logs is that of the step's last optimizer step."""
    return _assert_clean_run
