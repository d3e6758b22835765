"""Fixtures of the integration tests: a free local port and a one-rank gloo process group."""

import socket

import pytest
import torch.distributed as dist


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on."""
    return _free_port()


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo group (ActorPPOTrainer's barrier, the loss normalisers' all-reduces, the device mesh)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
