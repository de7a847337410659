"""The server's heap hygiene (``minillm/server/heap.py``): freed memory goes back to the OS."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

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


def _unset(monkeypatch, name: str) -> None:
    """Unset ``name`` for the test and have it restored after (``delenv`` of an unset variable
    records nothing, so what the code under test writes would outlive the test)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def test_kernel_caches_are_bounded_unless_the_operator_chose(monkeypatch):
    _unset(monkeypatch, "LRU_CACHE_CAPACITY")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")  # the operator's choice stays
    assert heap.bound_kernel_caches(64) == {"LRU_CACHE_CAPACITY": "64"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "4096"
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        heap.bound_kernel_caches(0)


GROWTH = """
import json, sys
from minillm.server import heap
if sys.argv[1] == "bounded":
    heap.bound_kernel_caches(16)
from minillm import LLM, SamplingParams
llm = LLM("tiny-shakespeare-8m", dtype="fp32", kv_cache_memory=16 << 20, compile=False, enable_prefix_caching=False)
run = lambda n: llm.generate(" ".join(["KING"] * n), SamplingParams(max_tokens=2, ignore_eos=True))
for n in (1, 2, 3):
    run(n)
before = heap.malloc_stats()["in_use"]
for n in range(4, 64):  # 60 prefill lengths never seen before: new kernel shapes for every linear layer
    run(n)
print(json.dumps((heap.malloc_stats()["in_use"] - before) / 1e6))
"""


@linux_glibc
@pytest.mark.skipif(heap._LIBC is None or not hasattr(heap._LIBC, "mallinfo2"), reason="mallinfo2 is glibc >= 2.33's")
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch: nothing cached")
def test_a_bounded_process_does_not_keep_a_kernel_per_prompt_length():
    """Issue 30's growth: every new prefill length makes oneDNN kernels for its shape, kept by two
    1,024-entry caches (1.92 MB per length on an Intel Xeon, ``bench_kernel_caches.py``). With
    the caches bounded the way ``minillm serve`` bounds them (here at 16 entries, so that 60
    lengths overflow them), the process keeps a small fraction of what the defaults keep."""
    grown = {}
    env = {k: v for k, v in os.environ.items() if k not in heap.KERNEL_CACHE_VARIABLES}
    for mode in ("default", "bounded"):
        done = subprocess.run([sys.executable, "-c", GROWTH, mode], capture_output=True, text=True, env=env,
                              cwd=Path(__file__).parents[1], timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        grown[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert grown["default"] > 40, grown  # what the defaults keep: the growth the soak saw
    assert grown["bounded"] < grown["default"] / 4, grown


def test_serve_bounds_the_caches_before_it_builds_an_engine(monkeypatch):
    from minillm.server import launch

    for name in heap.KERNEL_CACHE_VARIABLES:
        _unset(monkeypatch, name)
    seen = {}

    def build_engines(models, max_waiting, **engine_args):
        seen.update({name: os.environ.get(name) for name in heap.KERNEL_CACHE_VARIABLES})
        raise RuntimeError("stop here")

    monkeypatch.setattr(launch, "build_engines", build_engines)
    with pytest.raises(RuntimeError, match="stop here"):
        launch.serve(["tiny-shakespeare-1m"])
    assert seen == {name: str(heap.KERNEL_CACHE_CAPACITY) for name in heap.KERNEL_CACHE_VARIABLES}


def test_serve_freezes_the_start_ups_heap_once_its_engines_are_built(monkeypatch):
    """`minillm serve` freezes what start-up made (the model, the engines, torch's modules) after
    building its engines and before serving, so no collection walks it again; what requests
    allocate afterwards is still collected."""
    import gc

    from minillm.server import launch

    order, freeze = [], heap.freeze_startup_heap
    monkeypatch.setattr(launch, "build_engines", lambda *a, **k: order.append("engines") or {})
    monkeypatch.setattr(launch, "build_app", lambda *a, **k: order.append("app") or object())
    monkeypatch.setattr(launch.heap, "freeze_startup_heap", lambda: order.append("freeze"))
    monkeypatch.setattr(launch, "run_server", lambda *a, **k: order.append("serve"))
    launch.serve(["tiny-shakespeare-1m"])
    assert order == ["engines", "app", "freeze", "serve"]
    try:  # the real function, in this process: everything alive is frozen, new garbage still goes
        assert freeze() > 1000 and gc.get_freeze_count() > 1000

        class Cycle:
            pass

        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2  # a cycle made after the freeze is collected
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
