"""The CPU runtime's placement check: a run whose model groups ask for more fake GPUs than the local head has would
wait forever (upstream waits on its placement groups without a timeout), so it is refused by name first."""

import os
import subprocess
import sys

import pytest

from d3s_openrlhf.cpu import runtime
from d3s_openrlhf.integration import host

FLAGS = ["--actor.num_gpus_per_node", "2", "--reward.remote_url", "reward.py", "--algo.kl.init_coef", "0.01"]


def test_a_demand_above_the_heads_fake_gpus_is_refused_with_the_flags(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    flags = [*FLAGS, "--ref.num_gpus_per_node", "2"]
    runtime.check_gpu_demand(host.parse_host_args([*flags, "--vllm.num_engines", "2"]))  # 6 of 8: fits
    with pytest.raises(ValueError, match="ask for 10") as error:
        runtime.check_gpu_demand(host.parse_host_args([*flags, "--vllm.num_engines", "6"]))
    message = str(error.value)
    assert "--vllm.num_engines" in message and "--ref.num_nodes x --ref.num_gpus_per_node = 2" in message
    runtime.check_gpu_demand(host.parse_host_args([*flags, "--vllm.num_engines", "6"]), num_gpus=16)
    runtime.check_gpu_demand(host.parse_host_args([*flags, "--vllm.num_engines", "6", "--train.colocate_all"]))


def test_a_cluster_given_by_address_is_not_checked(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    runtime.check_gpu_demand(host.parse_host_args([*FLAGS, "--vllm.num_engines", "64"]))


# vLLM's AMX attention kernel died with SIGILL at the first request in 4 of 5 bf16 engine starts on the project's
# Intel Xeon VMs (CI's EngineDeadError). vLLM loads our plugin in each of its processes; it must steer the
# attention ISA to the portable kernel under the runtime, and leave vLLM alone outside it.
ISA_PROBE = """
import torch
torch.cpu._is_amx_tile_supported = lambda: True  # the choice AMX machines get, on any machine
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
print(_get_attn_isa(torch.bfloat16, 128, 64), _get_attn_isa(torch.float32, 128, 64))
"""


@pytest.mark.parametrize("runtime_on, expected", [(True, "vec vec"), (False, "amx vec")])
def test_the_vllm_plugin_keeps_the_runtimes_attention_off_amx(runtime_on, expected):
    pytest.importorskip("vllm")
    env = {key: value for key, value in os.environ.items() if key != runtime.ENV_FLAG}
    if runtime_on:
        env[runtime.ENV_FLAG] = "1"
    probe = subprocess.run([sys.executable, "-c", ISA_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip().splitlines()[-1] == expected


def test_a_local_head_that_times_out_starting_is_started_again_and_its_processes_stopped(monkeypatch):
    """Ray waits a fixed 30 s for its raylet to register; on a loaded machine (CI: two pytest processes on 2 cores)
    the head can miss it. The attempt's processes go and a new head starts."""
    import ray

    attempts, strays = [], []

    def init(**kwargs):
        attempts.append(kwargs)
        if len(attempts) == 1:
            strays.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    runtime.init_local_ray(num_cpus=2)
    assert attempts == [{"address": "local", "num_cpus": 2}] * 2
    assert strays[0].wait(timeout=10) is not None


def test_a_local_head_fails_with_rays_error_after_the_last_attempt(monkeypatch):
    import ray

    def init(**kwargs):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Exception, match="timed out during startup"):
        runtime.init_local_ray(num_cpus=2)


def test_other_errors_of_a_local_head_are_not_retried(monkeypatch):
    import ray

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise ValueError("num_gpus must be non-negative")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="non-negative"):
        runtime.init_local_ray(num_gpus=-1)
    assert len(calls) == 1
