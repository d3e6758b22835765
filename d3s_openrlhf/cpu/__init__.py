"""CPU runtime: runs OpenRLHF's real Ray pipeline (DeepSpeed actors, vLLM CPU engines) on a machine without a GPU.

Opt-in only (``D3S_OPENRLHF_CPU=1`` or ``python -m d3s_openrlhf.cli.cpu``); nothing here is imported by the
GPU code path. Entry point for other code: :func:`d3s_openrlhf.cpu.runtime.activate_if_requested`. The toy model,
tasks and runs that exercise it live apart, in :mod:`d3s_openrlhf.testbed`.
"""
