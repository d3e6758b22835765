"""Fixtures of the integration tests: a one-rank gloo process group and DeepSpeed on it, the actor tests' tiny Llama
(``model_dir``) with the CUDA calls OpenRLHF makes pointed at the CPU (``cpu_cuda``), and the liveness watches' Ray
instance and short pings."""

import sys
from pathlib import Path

import pytest
import ray
import torch.distributed as dist

from d3s_openrlhf.cpu import runtime
from d3s_openrlhf.integration import liveness

# the actor tests' model and batches, ``import actor_batches`` (tests/ is no package)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from actor_batches import as_one_deepspeed_rank, point_cuda_at_cpu, write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def watch_ray():
    """A local Ray instance of its own for the liveness watches' tests (their actors are tiny)."""
    runtime.init_local_ray(num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024**2)
    yield
    ray.shutdown()


@pytest.fixture
def short_pings(monkeypatch):
    """The watches ping every 0.2 s instead of every PING_INTERVAL_S, so that a death is seen at once."""
    monkeypatch.setattr(liveness, "PING_INTERVAL_S", 0.2)


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo group (ActorPPOTrainer's barrier, the loss normalisers' all-reduces, the device mesh)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama and its tokenizer in a temporary directory (``actor_batches.write_tiny_llama``)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path)
    return str(path)


@pytest.fixture
def one_rank_deepspeed(monkeypatch, process_group):
    """DeepSpeed on the one-rank gloo group (``actor_batches.as_one_deepspeed_rank``)."""
    return as_one_deepspeed_rank(monkeypatch)


@pytest.fixture
def cpu_cuda(monkeypatch, process_group):
    return point_cuda_at_cpu(monkeypatch)
