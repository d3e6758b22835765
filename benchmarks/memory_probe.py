"""Peak CPU memory allocated by torch while a function runs, from torch's own allocator events.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free made by torch's CPU allocator
as a ``[memory]`` event with its signed size and time stamp. Their running sum in time order is the memory
allocated since the profile started; its maximum is the peak extra memory of the call (tensors that existed
before are not counted). This is exact and independent of the OS allocator (unlike RSS), and works without CUDA.

Used by the memory benchmarks and by the test suite's ``peak_memory`` fixture; imports nothing but torch.
"""

from torch.profiler import ProfilerActivity, profile

MIB = 1 << 20


def peak_allocated_bytes(fn, *args, **kwargs):
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
