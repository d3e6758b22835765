"""The CPU runtime's ZeRO-3 gather (issue 30 item 5): DeepSpeed's blocking gather of several parameters waits for the
last of its async all-gathers only, which gloo may finish before the others; under the runtime it runs DeepSpeed's
sequential gather instead, one blocking all-gather per parameter. What the fault did on two ranks, and that the fix
removes it, is tests/integration/test_integration_experience_forward.py's. A fresh interpreter: the adjustments
replace attributes once per process, as in a Ray worker."""

import subprocess
import sys

PROBE = """
from d3s_openrlhf.cpu import patches

patches.apply()
from deepspeed.runtime.zero.partition_parameters import Init

class Params:
    def _allgather_params_sequential(self, param_list, hierarchy=0):
        print("sequential", param_list, hierarchy)

for quantize in (False, True):
    Init._allgather_params_coalesced(Params(), ["weight", "bias"], 0, quantize=quantize)
"""


def test_zero3_gathers_of_several_parameters_are_blocking_one_by_one():
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip().splitlines()[-2:] == ["sequential ['weight', 'bias'] 0"] * 2
