"""The scheduler's steady state at once (``Scheduler.reserve_decodes`` and
``BlockManager.allocate_decode_slots``): every plain decode of a step gets its token and slot in
one pass. It must decide exactly what the per-sequence walk (``tokens_to_run`` + ``reserve``,
sequence by sequence) decides — the same chunks, block copies, preemptions, block tables and pool
counters after every step, on random schedules with forks (shared blocks copied on write), block
boundaries, aborts and a pool small enough to preempt — and step aside whenever it cannot: a pool
too short for everyone (nothing changed), or a chapter-04 exercise's hook, called per sequence."""

from __future__ import annotations

import random

import pytest
import torch

import minillm.hooks as hooks
from minillm import LLMEngine, SamplingParams
from minillm.config import ModelConfig
from minillm.engine.scheduler import SchedulerOutput
from minillm.kvcache import addressing
from minillm.kvcache.block_manager import BlockManager

TINY = "data/tiny-shakespeare-1m"


def small_engine(window=None):
    config = ModelConfig.from_folder(TINY)
    per_token = addressing.kv_bytes_per_token(config, torch.float32)
    return LLMEngine(TINY, compile=False, max_num_seqs=12, max_num_batched_tokens=64, block_size=4,
                     kv_cache_memory=(12 if window else 24) * 4 * per_token, max_model_len=96, sliding_window=window)  # fmt: skip


def pool_state(engine) -> dict:
    bm = engine.block_manager
    return {
        "tables": {rid: list(t) for rid, t in bm.tables.items()},
        "num_tokens": dict(bm.num_tokens),
        "fill": list(bm.fill),
        "filled": bm.num_filled_slots,
        "reserved": bm.num_reserved_tokens,
        "free": list(bm.free_ids),
        "evictable": list(bm.evictable),
        "refs": [b.ref_count for b in bm.blocks],
    }


def drive(engine, seed: int) -> list[tuple]:
    """A random workload; what every step decided and left behind."""
    rng = random.Random(seed)
    stems = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter"]
    live, trace = [], []

    def step():
        deltas = engine.step()
        record = engine.step_records[-1] if engine.step_records else None
        trace.append((record.chunks if record else None, record.preempted if record else None,
                      [(d.request_id, d.index, d.token_ids) for d in deltas], pool_state(engine)))  # fmt: skip

    for _ in range(110):
        if rng.random() < 0.55:
            prompt = rng.choice(stems) + " " * rng.randrange(3) + str(rng.randrange(50))
            params = SamplingParams(max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 2, 3]),
                                    temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99), ignore_eos=True)  # fmt: skip
            live.append(engine.add_request(prompt, params))
        if live and rng.random() < 0.04:
            victim = live.pop(rng.randrange(len(live)))
            if victim in engine.requests:
                engine.abort(victim)
        step()
    while engine.has_unfinished_requests():
        step()
    return trace


@pytest.mark.parametrize("seed, window", [(0, None), (1, None), (2, 8)])
def test_at_once_decides_what_the_walk_decides_on_random_schedules(seed, window):
    walked = small_engine(window)
    reference_reserve = hooks.default("reserve")
    with hooks.override(reserve=lambda *args: reference_reserve(*args)):  # not the package's own: the walk
        expected = drive(walked, seed)
    walked.close()

    engine = small_engine(window)
    bm = engine.block_manager
    at_once = {"calls": 0, "decodes": 0, "grown": 0, "copies": 0}
    allocate = bm.allocate_decode_slots

    def counted(seqs):
        tables_before = sum(len(bm.tables[s.request_id]) for s in seqs)
        copies = allocate(seqs)
        if copies is not None:
            at_once["calls"] += 1
            at_once["decodes"] += len(seqs)
            at_once["grown"] += sum(len(bm.tables[s.request_id]) for s in seqs) - tables_before
            at_once["copies"] += len(copies)
        return copies

    bm.allocate_decode_slots = counted
    got = drive(engine, seed)
    engine.close()
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, f"step {i} differs"
    # What the random schedule covered: the path at once ran, over block boundaries and copies.
    assert at_once["calls"] > 50 and at_once["decodes"] > 300, at_once
    assert at_once["grown"] > 20 and at_once["copies"] > 0, at_once
    assert any(preempted for _, preempted, _, _ in got), "no preemption: the short-pool path went untested"


def test_a_pool_too_short_for_everyone_changes_nothing_and_the_walk_preempts():
    per_token = addressing.kv_bytes_per_token(ModelConfig.from_folder(TINY), torch.bfloat16)
    engine = LLMEngine(TINY, compile=False, dtype="bf16", max_num_seqs=4, block_size=4,
                       kv_cache_memory=3 * 4 * per_token, max_model_len=12)  # fmt: skip
    assert engine.block_manager.num_blocks == 3
    for prompt in ([5, 6, 7, 8], [9, 10, 11, 12]):  # a full block each: the next token needs a second
        engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()  # both prompts prefilled: two blocks full, one free
    bm = engine.block_manager
    seqs = engine.scheduler.running_in_order()
    before = pool_state(engine)
    assert bm.allocate_decode_slots(seqs) is None
    assert pool_state(engine) == before
    assert engine.scheduler.reserve_decodes(seqs, 64, SchedulerOutput()) == 0
    assert pool_state(engine) == before
    engine.step()  # the walk: the first takes the free block, the second is preempted
    assert engine.step_records[-1].preempted == [1]
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()


def test_allocate_decode_slots_is_allocate_slots_for_each():
    """Unit: the same tables, counters and copies as ``allocate_slots(seq, 1)`` per sequence —
    a sequence inside its block, one at a block boundary, one whose last block is shared."""

    class Seq:
        def __init__(self, request_id, n):
            self.request_id, self.num_computed_tokens = request_id, n
            self.token_ids = list(range(n))

    def build():
        bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
        seqs = [Seq("inside", 5), Seq("boundary", 8), Seq("shared", 6)]
        for seq in seqs:
            done = seq.num_computed_tokens
            bm.match_prefix(seq)  # nothing cached: 0 computed
            bm.allocate_slots(seq, done)
            seq.num_computed_tokens = done
        child = Seq("child", 6)
        bm.fork(seqs[2], child)
        return bm, seqs + [child]

    one_by_one, seqs = build()
    expected = [c for s in seqs for c in one_by_one.allocate_slots(s, 1)]
    at_once, seqs2 = build()
    assert at_once.allocate_decode_slots(seqs2) == expected and expected  # the shared block was copied
    for name in ("tables", "num_tokens", "fill", "num_filled_slots", "num_reserved_tokens"):
        assert getattr(at_once, name) == getattr(one_by_one, name), name
    assert list(at_once.free_ids) == list(one_by_one.free_ids)


def test_a_learners_reserve_or_tokens_to_run_is_called_for_every_sequence():
    engine = LLMEngine(TINY, compile=False, max_num_seqs=4)
    for prompt in ("To be", "Friends", "Now is", "O Romeo"):
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()
    for name in ("reserve", "tokens_to_run"):
        calls = []
        reference = hooks.default(name)

        def mine(scheduler, seq, *args, reference=reference, calls=calls):
            calls.append(seq.request_id)
            return reference(scheduler, seq, *args)

        with hooks.override(**{name: mine}):
            engine.step()
        assert sorted(calls) == [0, 1, 2, 3], (name, calls)
    engine.close()
