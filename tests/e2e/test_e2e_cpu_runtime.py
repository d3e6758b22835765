"""The CPU launcher itself: its Ray head (loopback only, fake GPUs), the adjustments inside Ray workers, and
that nothing it started survives a normal exit, an error or Ctrl-C."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

# A module run by the launcher: one GPU actor reports what a worker sees, then the module waits or fails.
PROBE_MODULE = textwrap.dedent(
    """
    import json, os, sys, time
    import ray

    @ray.remote(num_gpus=1)
    class Probe:
        def report(self):
            import torch
            torch.cuda.set_device(0)  # a no-op stand-in on CPU (raises without the runtime)
            torch.cuda.synchronize()
            return {
                "current_device": str(torch.cuda.current_device()),
                "kvcache": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                "vllm_multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                "node_ip": ray.util.get_node_ip_address(),
            }

    probe = Probe.remote()
    report = ray.get(probe.report.remote())
    report["gpus"] = ray.cluster_resources().get("GPU")
    report["driver_pid"] = os.getpid()
    print("PROBE " + json.dumps(report), flush=True)
    mode = sys.argv[1]
    if mode == "fail":
        raise RuntimeError("probe failure")
    if mode == "wait":
        while True:
            time.sleep(1)
    """
)


def listening_addresses(pids):
    """Local addresses of the TCP listening sockets owned by ``pids`` (from ``ss -ltnp``)."""
    output = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    addresses = []
    for line in output.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            addresses.append(line.split()[3].rsplit(":", 1)[0])
    return addresses


def start(tmp_path, mode, marker):
    (tmp_path / "d3s_probe_module.py").write_text(PROBE_MODULE)
    run_id = uuid.uuid4().hex
    env = dict(os.environ, **{marker: run_id}, PYTHONPATH=str(tmp_path))
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "d3s_openrlhf.cli.cpu", "d3s_probe_module", mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # even if pytest runs in background
    )
    report, lines = None, []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("PROBE "):
            report = json.loads(line[len("PROBE ") :])
            break
    return process, run_id, report, lines


def finish(process, lines, timeout=120):
    output, _ = process.communicate(timeout=timeout)
    return "".join(lines) + output


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_worker_adjustments_loopback_head_and_clean_exit(tmp_path, run_processes):
    process, run_id, report, lines = start(tmp_path, "wait", run_processes.marker)
    assert report is not None, "".join(lines)[-3000:]
    try:
        assert report["current_device"] == "cpu"  # torch.cuda stand-ins inside a Ray worker
        assert report["kvcache"] == "1"  # the job's runtime environment reached the worker
        assert report["vllm_multiprocessing"] == "0"
        assert report["gpus"] == 8  # fake GPU resources for OpenRLHF's placement groups
        assert report["node_ip"] == "127.0.0.1"
        addresses = listening_addresses(run_processes.alive(run_id))
        assert addresses, "no listening socket found for the Ray head"
        assert set(addresses) <= {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"}, addresses
        os.kill(process.pid, signal.SIGINT)  # Ctrl-C: the launcher stops its head
        output = finish(process, lines)
        assert process.returncode != 0 and "KeyboardInterrupt" in output, output[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
        assert run_processes.leftover(run_id, grace_s=30) == [], "processes outlived the launcher after Ctrl-C"


@pytest.mark.e2e
def test_error_in_module_stops_the_head(tmp_path, run_processes):
    process, run_id, report, lines = start(tmp_path, "fail", run_processes.marker)
    output = finish(process, lines)
    assert report is not None and report["current_device"] == "cpu", output[-3000:]
    assert process.returncode == 1 and "probe failure" in output, output[-3000:]
    assert run_processes.leftover(run_id, grace_s=30) == [], "processes outlived the launcher after an error"


# A GPU user's command with upstream's defaults (no --vllm.num_engines, flash_attention_2): refused by name
# before any Ray process exists, through the launcher and through the opt-in variable, D3S on and off.
GPU_STYLE = [
    *("--actor.model_name_or_path", "some/model"),
    *("--reward.remote_url", "reward.py"),
    *("--algo.advantage.estimator", "group_norm"),
    *("--rollout.batch_size", "8"),
    *("--rollout.n_samples_per_prompt", "8"),
    *("--train.batch_size", "32"),
    *("--actor.num_gpus_per_node", "1"),
    *("--ref.num_gpus_per_node", "1"),
]
D3S_FLAGS = ["--d3s.preset", "d3s", "--d3s.n_final", "8"]


@pytest.mark.parametrize(
    "command, via_env",
    [
        (["d3s_openrlhf.cli.cpu", "openrlhf.cli.train_ppo_ray"], False),
        (["d3s_openrlhf.cli.cpu", "d3s_openrlhf.cli.train_ppo_ray", *D3S_FLAGS], False),
        (["d3s_openrlhf.cli.train_ppo_ray"], True),
        (["d3s_openrlhf.cli.train_ppo_ray", *D3S_FLAGS], True),
    ],
    ids=["launcher_upstream", "launcher_d3s", "env_d3s_off", "env_d3s_on"],
)
def test_gpu_style_command_is_refused_before_ray(command, via_env, run_processes):
    run_id = uuid.uuid4().hex
    env = dict(os.environ, **{run_processes.marker: run_id})
    env.pop("RAY_ADDRESS", None)
    env.pop("D3S_OPENRLHF_CPU", None)
    if via_env:
        env["D3S_OPENRLHF_CPU"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", *command, *GPU_STYLE], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "add --vllm.num_engines 1" in result.stderr, result.stderr[-3000:]
    assert "Started a local Ray instance" not in result.stdout + result.stderr
    assert run_processes.leftover(run_id, grace_s=5) == []
