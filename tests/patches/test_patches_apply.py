"""The fork-style patch: applies cleanly to OpenRLHF 0.11.2's sources, is idempotent, refuses other sources, and
makes upstream's own entrypoint hand `--d3s.*` runs to d3s_openrlhf."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import openrlhf
import pytest

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "patches" / "apply.sh"
HOST = [
    *("--algo.advantage.estimator", "group_norm"),
    *("--rollout.batch_size", "8"),
    *("--rollout.n_samples_per_prompt", "16"),
    *("--rollout.micro_batch_size", "2"),
    *("--train.batch_size", "32"),
    *("--actor.num_nodes", "1"),
    *("--actor.num_gpus_per_node", "2"),
]


@pytest.fixture
def openrlhf_copy(tmp_path):
    """A pristine copy of the installed openrlhf 0.11.2 package, importable from tmp_path."""
    shutil.copytree(Path(openrlhf.__file__).parent, tmp_path / "openrlhf", ignore=shutil.ignore_patterns("*.pyc"))
    return tmp_path


def apply(target):
    return subprocess.run(["bash", str(APPLY), str(target)], capture_output=True, text=True)


def run_patched(target, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(REPO)]))
    return subprocess.run(
        [sys.executable, "-m", "openrlhf.cli.train_ppo_ray", *args], capture_output=True, text=True, env=env, cwd=target
    )


def test_applies_cleanly_once_and_is_idempotent(openrlhf_copy):
    entry = openrlhf_copy / "openrlhf" / "cli" / "train_ppo_ray.py"
    pristine = entry.read_text()
    first = apply(openrlhf_copy)
    assert first.returncode == 0 and "patched" in first.stdout, first.stderr
    patched = entry.read_text()
    assert patched != pristine and "d3s_openrlhf.cli.train_ppo_ray" in patched
    compile(patched, str(entry), "exec")
    second = apply(openrlhf_copy)
    assert second.returncode == 0 and "already applied" in second.stdout
    assert entry.read_text() == patched


def test_refuses_sources_it_does_not_match(openrlhf_copy):
    entry = openrlhf_copy / "openrlhf" / "cli" / "train_ppo_ray.py"
    foreign = entry.read_text().replace('if __name__ == "__main__":\n    parser', 'if __name__ == "__main__":\n    p')
    entry.write_text(foreign)
    result = apply(openrlhf_copy)
    assert result.returncode == 1 and "does not apply cleanly" in result.stderr
    assert entry.read_text() == foreign


def test_patched_upstream_entrypoint_runs_d3s(openrlhf_copy):
    assert apply(openrlhf_copy).returncode == 0
    result = run_patched(openrlhf_copy, "--d3s.preset", "d3s", "--d3s.n_final", "16", "--d3s.dry_run", *HOST)
    assert result.returncode == 0, result.stderr
    assert "p = 1.00:  N =  16  kept rollouts    128 / 128 (100.0%)  optimizer steps 4 x 32 rollouts  K = 0.2000" in (
        result.stdout
    )

    # bad D3S input is rejected by the plugin's validation, naming the flag, before any Ray work
    bad = run_patched(openrlhf_copy, "--d3s.preset", "d3s", "--d3s.k_init", "1.5", "--d3s.dry_run", *HOST)
    assert bad.returncode == 2 and "--d3s.k_init" in bad.stderr


def test_patched_upstream_entrypoint_hands_lora_runs_to_the_plugin(openrlhf_copy):
    # LoRA without any --d3s flag: the plugin's merged weight sync is needed; its pre-flight answers first
    assert apply(openrlhf_copy).returncode == 0
    result = run_patched(openrlhf_copy, "--ds.lora.rank", "8", "--ds.tensor_parallel_size", "2", *HOST)
    assert result.returncode == 2 and "d3s_openrlhf.cli.train_ppo_ray: error" in result.stderr
    assert "--ds.tensor_parallel_size 1" in result.stderr
