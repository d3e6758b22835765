from setuptools import find_packages, setup

setup(
    name="d3s-openrlhf",
    version="0.1.0",
    description="Dynamic Dual-Level Down-Sampling (D3S) and PODS rollout/token selection for OpenRLHF",
    packages=find_packages(include=["d3s_openrlhf", "d3s_openrlhf.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.1"],
    extras_require={
        "openrlhf": ["openrlhf>=0.11.0,<0.12"],
        "math": ["math-verify>=0.7"],
        "test": ["pytest", "hypothesis"],
    },
)
