"""The CPU allocator's peak while a function runs, from the profiler's allocation events (each carries its size;
a free, minus its size), for the tests that compare measured bytes with the memory plan's formula or bound what a
compiled graph holds. The events are an internal API, so their absence fails the test: a torch upgrade must not
silently drop these checks."""

import pytest


def allocator_peak(fn, warm_up=True):
    """The most bytes the CPU allocator held during fn(), beyond what it held before (with warm_up, fn runs once
    unmeasured first, so tensors it keeps from one call to the next, such as gradients, exist from the start)."""
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        pytest.fail(f"torch's profiler allocation events are gone ({e}): update tests/allocator.py for this torch")
    if warm_up:
        fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    held = peak = 0
    for _, size in sorted(allocations):
        held += size
        peak = max(peak, held)
    return peak
