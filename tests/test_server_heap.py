"""The server's heap hygiene (``minillm/server/heap.py``): freed memory goes back to the OS."""

import sys
import threading

import psutil
import pytest

from minillm.server import heap

linux_glibc = pytest.mark.skipif(heap._LIBC is None, reason="malloc_trim and mallopt are glibc's (Linux)")


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


@linux_glibc
def test_a_trim_returns_a_fragmented_threads_heap():
    """200 MB of 1 kB buffers from a worker thread (its own arena, as a parsing thread has), every
    50th kept alive: free() alone cannot return the holes between them; the trim does."""
    kept = {}

    def work():
        buffers = [bytes(1000) + bytes([i % 256]) for i in range(200_000)]
        kept["every_50th"] = buffers[::50]

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    before = _rss_mb()
    assert heap.trim() is True
    assert before - _rss_mb() > 100, "the freed 196 MB between kept buffers stayed resident"
    assert len(kept["every_50th"]) == 4000  # still alive: only free pages were returned


@linux_glibc
def test_the_arena_cap_is_accepted():
    assert heap.limit_arenas(heap.ARENA_MAX) is True


def test_a_nonsense_cap_is_refused():
    with pytest.raises(ValueError, match="count must be at least 1"):
        heap.limit_arenas(0)


@pytest.mark.skipif(sys.platform.startswith("linux"), reason="elsewhere than Linux the calls do nothing")
def test_elsewhere_nothing_happens():
    assert heap.trim() is False


def test_a_served_engine_keeps_no_step_records():
    """A server steps for hours: the engine's default of 10,000 step records would be built and
    carried for nothing. The server reads none, so it keeps none."""
    from minillm import SamplingParams
    from minillm.server.launch import build_engines

    engine = build_engines(["tiny-shakespeare-1m"], dtype="fp32", kv_cache_memory=2_000_000)["tiny-shakespeare-1m"].engine
    engine.add_request("KING.", SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_steps > 0 and len(engine.step_records) == 0
    kept = build_engines(["tiny-shakespeare-1m"], dtype="fp32", kv_cache_memory=2_000_000, max_step_records=8)
    assert kept["tiny-shakespeare-1m"].engine.step_records.maxlen == 8  # asked for: kept
