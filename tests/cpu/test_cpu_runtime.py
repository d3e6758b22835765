"""The CPU runtime's placement check: a run whose model groups ask for more fake GPUs than the local head has would
wait forever (upstream waits on its placement groups without a timeout), so it is refused by name first."""

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
    assert "--vllm.num_engines" in str(error.value) and "--ref.num_nodes x --ref.num_gpus_per_node = 2" in str(error.value)
    runtime.check_gpu_demand(host.parse_host_args([*flags, "--vllm.num_engines", "6"]), num_gpus=16)
    runtime.check_gpu_demand(host.parse_host_args([*flags, "--vllm.num_engines", "6", "--train.colocate_all"]))


def test_a_cluster_given_by_address_is_not_checked(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    runtime.check_gpu_demand(host.parse_host_args([*FLAGS, "--vllm.num_engines", "64"]))
