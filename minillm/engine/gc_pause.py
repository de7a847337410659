"""No cyclic garbage collection in the middle of a step: the step's short-lived objects die young.

A decode step at 1,024 sequences makes about ten thousand small container objects — a
scheduled chunk, an input row, a delta, their lists, per sequence — and drops nearly all of
them before it returns. CPython's cyclic collector does not know that: it runs whenever 700
more containers have been made than freed, so it ran about 13 times inside every such step.
Each time, whatever the step still held was judged a survivor and moved to an older
generation, and once those "survivors" add up to a quarter of the old generation, CPython
walks *every* tracked object of the process — a few hundred thousand, nearly all of them
torch's and transformers' modules. Measured with a model that costs nothing (1,024 sequences,
1 thread, ``python benchmarks/bench_step_overhead.py``): 4 such walks in 60 steps, ~120 ms each,
8 ms added to the mean step of 13 ms; nothing collected by any of them (``docs/benchmarks.md``).

So the step runs with the collector paused. The objects it drops are freed by reference
counting as always (the collector is only for cycles); what is still alive after the step is
looked at by the next collection, which then finds the step's garbage already gone. Cyclic
garbage made during a step is collected after it, not leaked (``tests/test_gc_pause.py``).

A process may run several engines' steps at once (one per thread — ``minillm serve`` with
several models): the first step to start pauses the collector and the last to end resumes it.
Engines that step back to back could then keep it paused for good, so a step that ends while
another still runs collects what CPython would have collected by now (its young generations,
whose counts passed their thresholds) — the behaviour before the pause, for such processes only.
A collector that was already off when the first step began (``gc.disable()`` by the user) stays
off; one turned off *during* a step is turned on again when the steps end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_inside = 0  # steps running now, in every thread
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Run the ``with`` body with CPython's cyclic collector off; restore it after, also on errors."""
    global _inside, _resume
    with _LOCK:
        if _inside == 0:
            _resume = gc.isenabled()
            gc.disable()
        _inside += 1
    try:
        yield
    finally:
        with _LOCK:
            _inside -= 1
            overlapping = _inside > 0 and _resume
            if _inside == 0 and _resume:
                gc.enable()
        if overlapping:
            collect_what_is_due()


def collect_what_is_due() -> None:
    """Run the collection CPython's allocator would have started by now, if any: the oldest of
    generations 0 and 1 whose count passed its threshold (a full collection stays CPython's to
    decide, once the collector is on again)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (1, 0):
        if thresholds[generation] and counts[generation] > thresholds[generation]:
            gc.collect(generation)
            return
