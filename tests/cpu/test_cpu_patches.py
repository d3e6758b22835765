"""The CPU runtime's ZeRO-3 gather (issue 30 item 5): DeepSpeed's blocking gather of several parameters waits for the
last of its async all-gathers only, which gloo may finish before the others; under the runtime it runs DeepSpeed's
sequential gather instead, one blocking all-gather per parameter. Here on one process, with an all-gather that
completes when waited on (the order gloo's thread pool may take); what the fault did on two ranks, and that the fix
removes it, is tests/integration/test_integration_experience_forward.py's."""

import subprocess
import sys

import pytest
import torch

from d3s_openrlhf.cpu import patches

pytest.importorskip("deepspeed")
from deepspeed.runtime.zero import partition_parameters  # noqa: E402

UPSTREAM = partition_parameters.Init._allgather_params_coalesced
WORLD = 2


class _CompletesWhenWaited:
    """An async all-gather whose output is written at ``wait()``; until then it holds NaN (not arrived)."""

    def __init__(self, output, parts):
        self.output, self.parts = output, parts
        output.fill_(float("nan"))

    def wait(self, **kwargs):
        self.output.copy_(torch.cat(self.parts))


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    parts = [input_tensor.clone(), input_tensor + 100]  # this rank's partition, then the other rank's
    work = _CompletesWhenWaited(output_tensor, parts)
    if async_op:
        return work
    work.wait()


class _Ranks:
    """What DeepSpeed's two blocking gathers read of their ``Init``: this process is rank 0 of 2."""

    local_device = torch.device("cpu")
    use_all_gather_into_tensor = True
    _allgather_params_sequential = partition_parameters.Init._allgather_params_sequential

    def _partition_world_size(self, param):
        return WORLD

    def _partition_rank(self, param):
        return 0

    def get_partition_dp_group(self, param):
        return None


def _partitioned(shape, start):
    """A parameter as ZeRO-3 leaves it: empty data, this rank's half in ``ds_tensor``."""
    numel = torch.Size(shape).numel()
    param = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    param.ds_tensor = torch.arange(start, start + numel // WORLD, dtype=torch.float32)
    param.ds_tensor.ds_numel = numel // WORLD
    param.ds_numel, param.ds_shape = numel, torch.Size(shape)
    return param


@pytest.mark.parametrize("gather", [UPSTREAM, patches._allgather_params_blocking], ids=["deepspeed", "cpu_runtime"])
def test_every_parameter_is_whole_when_the_blocking_gather_returns(gather, monkeypatch):
    monkeypatch.setattr(partition_parameters.dist, "all_gather_into_tensor", _all_gather_into_tensor)
    weight, bias = _partitioned((4, 3), 0), _partitioned((4,), 50)  # a q_proj as transformers loads it
    gather(_Ranks(), [weight, bias])
    torch.testing.assert_close(bias.data, torch.tensor([50.0, 51, 150, 151]))  # the one DeepSpeed waits for
    whole = torch.cat([torch.arange(6.0), torch.arange(6.0) + 100]).view(4, 3)
    if gather is UPSTREAM:  # launched, never waited on: read before it arrived
        assert torch.isnan(weight.data).all()
    else:
        torch.testing.assert_close(weight.data, whole)


PROBE = """
from d3s_openrlhf.cpu import patches

patches.apply()
from deepspeed.runtime.zero.partition_parameters import Init

print(Init._allgather_params_coalesced is patches._allgather_params_blocking)
"""


def test_the_runtime_installs_it_where_deepspeed_is_imported():
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip().splitlines()[-1] == "True"
