"""CPU smoke runs of the launch scripts (``python -m d3s_openrlhf.cli.smoke_script``): two real steps of
``examples/scripts/qwen2.5-math-1.5b/gspo_d3s.sh`` on two Ray nodes (``--actor.num_nodes 2``) and of PODS's LoRA
setting ``examples/scripts/qwen2.5-3b-instruct/grpo_pods.sh`` on one, through the script's own ``ray job submit``
to a Ray cluster on 127.0.0.1 (working_dir upload of the checkout included), with the toy model, data and sizes
swapped in and every other flag as the script sets it. The other scripts share common.sh and differ in their flags,
which tests/examples/test_examples_scripts.py checks through the entrypoint's dry run.
"""

import math
from pathlib import Path

import pytest

from d3s_openrlhf.testbed import smoke
from d3s_openrlhf.testbed.smoke_inputs import prepare_toy

SCRIPTS = Path(__file__).resolve().parents[2] / "examples" / "scripts"


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory, toy_sft):
    return prepare_toy(str(tmp_path_factory.mktemp("smoke_toy")), prepared=toy_sft)


def assert_smoke_run(result, nodes):
    log = Path(result.log).read_text(errors="replace")
    assert result.returncode == 0, f"exit {result.returncode}\n{log[-6000:]}"
    assert not result.leftovers, f"processes of the cluster outlived it: {result.leftovers}"
    assert list(result.steps) == list(range(1, smoke.STEPS + 1)), f"logged steps {list(result.steps)}\n{log[-4000:]}"
    for step, values in result.steps.items():
        assert math.isfinite(values["policy_loss"]), (step, values["policy_loss"])
        assert 8 <= values["d3s/n"] <= 32, (step, values["d3s/n"])  # the script's N ran (D3S: 8 -> 32; PODS: 16)
    assert "_ray_pkg_" in log, "the checkout was not uploaded as the job's working_dir"
    assert f"--actor.num_nodes {nodes}" in log.replace("'", "")


# the paper-scale D3S script on two Ray nodes (nothing may assume one node), PODS's LoRA script on one, past its
# first merged weight sync
@pytest.mark.parametrize("script, nodes", [("qwen2.5-math-1.5b/gspo_d3s", 2), ("qwen2.5-3b-instruct/grpo_pods", 1)])
@pytest.mark.e2e
def test_script_runs_two_steps_on_cpu(script, nodes, toy_files, tmp_path):
    result = smoke.run_script(str(SCRIPTS / f"{script}.sh"), toy_files, str(tmp_path), nodes=nodes, timeout=600)
    assert_smoke_run(result, nodes=nodes)
    log = Path(result.log).read_text(errors="replace")
    if "3b-instruct" in script:
        assert "--ds.lora.rank 64" in log.replace("'", "")
    else:  # the paper-scale loss (KL loss, K < 1): no full logits in the training forward
        assert "[d3s] training forward with chunked logits: log-probs at every action token" in log
