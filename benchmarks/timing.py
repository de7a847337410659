"""The one timing helper the micro-benchmarks share: a call's median time after a warm-up."""

from __future__ import annotations

import time


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn``, after one untimed call (caches, allocator)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3
