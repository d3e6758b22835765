"""The CPU runtime's float32 switch (the launcher's ``--fp32``): one environment variable, set in the driver and
passed to every Ray worker, read by the patches (:mod:`d3s_openrlhf.cpu.patches`) and the vLLM rollout actor
(:mod:`d3s_openrlhf.cpu.vllm_engine`)."""

import os

FP32_ENV = "D3S_OPENRLHF_CPU_FP32"


def fp32_requested():
    """Whether ``D3S_OPENRLHF_CPU_FP32`` asks for float32 (``1``); raises ValueError on other values than 0/1."""
    value = os.environ.get(FP32_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FP32_ENV}={value!r}: set it to 1 (float32 everywhere) or 0 / unset (--ds.param_dtype)")
    return value == "1"
