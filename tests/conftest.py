"""Shared fixtures. ``toy_sft``: the SFT warm start of the toy model, once per session (every real Ray run of the
suite, end-to-end and launch-script smoke, starts from it). ``peak_memory``: peak CPU memory allocated while a
function runs, from torch's own allocator events.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free made by torch's CPU allocator
as a ``[memory]`` event with its signed size and time stamp. Their running sum in time order is the memory
allocated since the profile started; its maximum is the peak extra memory of the call (tensors that existed
before are not counted). This is exact and independent of the OS allocator (unlike RSS), and works without CUDA.
"""

import pytest
from torch.profiler import ProfilerActivity, profile


def _peak_allocated_bytes(fn, *args, **kwargs):
    """Returns ``(fn(*args, **kwargs), peak bytes allocated by torch above the level at the call)``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    events = sorted(
        (event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    level = peak = 0
    for event in events:
        level += event.nbytes()
        peak = max(peak, level)
    return result, peak


@pytest.fixture(scope="session")
def toy_sft(tmp_path_factory):
    """``pipeline.Prepared`` of the built-in addition task: the demo's SFT (~40% of sampled answers right), so that
    nearly every group has reward variance and every optimizer window sees non-zero advantages (OpenRLHF logs
    the grad norm of a step's last window only)."""
    from d3s_openrlhf.cpu import pipeline

    return pipeline.prepare(str(tmp_path_factory.mktemp("toy")))


@pytest.fixture
def peak_memory():
    """``peak_memory(fn, *args, **kwargs)`` -> ``(result, peak bytes allocated during the call)``."""
    return _peak_allocated_bytes
