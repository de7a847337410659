"""The cyclic collector is paused for a step and only for a step (``engine/gc_pause.py``): no
collection starts inside one however much it allocates, the collector is back on after it
(also after an error), a user's ``gc.disable()`` is kept, overlapping steps in several threads
resume it only when the last ends, and cyclic garbage a step makes is collected, not leaked."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import minillm.hooks as hooks
from minillm import LLMEngine, SamplingParams
from minillm.engine.gc_pause import collection_paused

TINY = "data/tiny-shakespeare-1m"


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(TINY, compile=False, max_num_seqs=4)
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def collector_on():
    """Every test starts with the collector on, and leaves it as it found it."""
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


class Cycle:
    def __init__(self):
        self.me = self


def test_no_collection_starts_inside_a_step_and_the_collector_is_back_after(engine):
    seen = {"enabled_inside": [], "collections_inside": 0}
    inside = [False]

    def on_gc(phase, info):
        if phase == "start" and inside[0]:
            seen["collections_inside"] += 1

    def noisy_detokenize_step(*args):
        inside[0] = True
        seen["enabled_inside"].append(gc.isenabled())
        junk = [{"n": i} for i in range(5_000)]  # far past the 700 allocations that start a collection
        del junk
        inside[0] = False
        return hooks.default("detokenize_step")(*args)

    gc.callbacks.append(on_gc)
    try:
        with hooks.override(detokenize_step=noisy_detokenize_step):
            engine.add_request("To be, or not to be", SamplingParams(max_tokens=4, stop=["zzz"]))
            while engine.has_unfinished_requests():
                engine.step()
                assert gc.isenabled()
    finally:
        gc.callbacks.remove(on_gc)
    assert seen["enabled_inside"] and not any(seen["enabled_inside"])
    assert seen["collections_inside"] == 0


def test_an_error_inside_a_step_turns_the_collector_back_on(engine):
    def broken(*args):
        raise RuntimeError("boom")

    engine.add_request("O Romeo", SamplingParams(max_tokens=3, stop=["zzz"]))
    with hooks.override(detokenize_step=broken), pytest.raises(RuntimeError, match="boom"):
        while engine.has_unfinished_requests():
            engine.step()
    assert gc.isenabled()
    for request_id in list(engine.requests):
        engine.abort(request_id)


def test_a_users_disabled_collector_stays_disabled(engine):
    gc.disable()
    engine.add_request("Friends, Romans", SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert not gc.isenabled()


def test_cyclic_garbage_made_in_a_step_is_collected_after_it(engine):
    made = []

    def cyclic_detokenize_step(*args):
        cycle = Cycle()
        made.append(weakref.ref(cycle))
        return hooks.default("detokenize_step")(*args)

    with hooks.override(detokenize_step=cyclic_detokenize_step):
        engine.add_request("What light", SamplingParams(max_tokens=3, stop=["zzz"]))
        while engine.has_unfinished_requests():
            engine.step()
    assert made
    gc.collect()  # reference counting never frees a cycle: the collector, on again, does (not frozen)
    assert all(ref() is None for ref in made)


def test_overlapping_steps_resume_the_collector_only_when_the_last_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    states = {}

    def first():
        with collection_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with collection_paused():
            second_in.set()
            first_out.wait(5)
            states["after_first_left"] = gc.isenabled()
        states["after_both_left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert states == {"after_first_left": False, "after_both_left": True}


def test_a_step_ending_while_another_runs_collects_what_is_due():
    """Engines stepping back to back in two threads could keep the collector paused for good: a
    step that ends while another still runs collects the young generations that are due."""
    first_in, second_out = threading.Event(), threading.Event()
    made, collections = [], []

    def on_gc(phase, info):
        if phase == "start" and first_in.is_set() and not second_out.is_set():
            collections.append(info["generation"])

    def first():
        with collection_paused():
            first_in.set()
            second_out.wait(10)

    def second():
        first_in.wait(10)
        with collection_paused():
            cycles = [Cycle() for _ in range(2_000)]  # past gen 0's threshold of 700
            made.extend(weakref.ref(c) for c in cycles)
            del cycles
        second_out.set()

    gc.callbacks.append(on_gc)
    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        gc.callbacks.remove(on_gc)
    assert collections, "no collection while the first step still ran"
    assert all(ref() is None for ref in made)  # the second step's cycles went with it
    assert gc.isenabled()
