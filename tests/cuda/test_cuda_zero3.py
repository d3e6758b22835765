"""ZeRO-3 over NCCL at world size 1 (issue 50 item 5): after one optimizer step of a DeepSpeed ZeRO-3 engine, the
training forward against ``Actor.forward`` on the same model without DeepSpeed (log-probs and every parameter's
full gradient), then the chunked experience forward (log-probs and entropy). The CPU suite runs the same check over
gloo (tests/integration/test_integration_actor.py).

    pytest -m cuda tests/core tests/cuda      # on a GPU machine: torch, transformers, deepspeed, openrlhf

Skipped without CUDA. Needs no Ray and no vLLM."""

import pytest
import torch
import torch.distributed as dist
from actor_batches import as_one_deepspeed_rank, assert_zero3_forwards_equal_upstreams

from d3s_openrlhf.cpu.ports import free_port

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def nccl_group(monkeypatch):
    """A one-rank NCCL group, its store in this process (no rendezvous); DeepSpeed adopts it
    (``actor_batches.as_one_deepspeed_rank``)."""
    as_one_deepspeed_rank(monkeypatch, MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_zero3_forwards_over_nccl_equal_upstreams_after_an_optimizer_step(model_dir, nccl_group):
    assert_zero3_forwards_equal_upstreams(model_dir, "cuda", dict(rtol=1e-4, atol=1e-5), dict(rtol=1e-4, atol=1e-5))
