"""Chapters 03-04 checks: reference answers pass, typical wrong answers fail with a useful message."""

from __future__ import annotations

import pytest

from minillm.course import (
    check_block_allocation,
    check_block_hash,
    check_continuous_schedule,
    check_slot_mapping,
)
from minillm.course.results import PASS, CheckFailed
from minillm.engine.scheduler import SchedulerOutput
from minillm.sequence import SequenceStatus


def slot_mapping(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def block_hash(parent_hash, token_ids):
    return hash((parent_hash, tuple(token_ids)))


def take_free_block(bm):
    if bm.free_ids:
        block_id = bm.free_ids.popleft()
    else:
        block_id, _ = bm.evictable.popitem(last=False)
        del bm.cached[bm.blocks[block_id].hash]
        bm.blocks[block_id].hash = None
    bm.blocks[block_id].ref_count = 1
    return block_id


def release_block(bm, block_id):
    block = bm.blocks[block_id]
    if block.ref_count == 0:
        raise RuntimeError(f"double free of block {block_id}")
    block.ref_count -= 1
    if block.ref_count == 0:
        if block.hash is not None:
            bm.evictable[block_id] = None
        else:
            bm.free_ids.append(block_id)


def schedule_continuous(scheduler):
    out = SchedulerOutput()
    budget = scheduler.max_num_batched_tokens
    for seq in scheduler.running_in_order():
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING:
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and scheduler.reserve(seq, n, out):
            budget -= n
    if not out.preempted:
        for seq in scheduler.waiting_in_order():
            if len(scheduler.running) >= scheduler.max_num_seqs or budget == 0:
                break
            n = scheduler.try_admit(seq, budget, out)
            if n == 0:
                break
            budget -= n
    return out


def test_reference_answers_pass():
    assert check_slot_mapping(slot_mapping).status == PASS
    assert check_block_hash(block_hash).status == PASS
    assert check_block_allocation(take_free_block, release_block).status == PASS
    assert check_continuous_schedule(schedule_continuous).status == PASS


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (lambda t, s, n, b: list(range(s, s + n)), "returned the positions themselves"),
        (lambda t, s, n, b: [p % b for p in range(s, s + n)], "offsets inside blocks"),
        (lambda t, s, n, b: [t[p // b] * b + p % b for p in range(s, s + n - 1)], "returned"),
    ],
)
def test_wrong_slot_mappings(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_slot_mapping(wrong)


def test_unchained_hash_fails():
    with pytest.raises(CheckFailed, match="different prefixes got the same hash"):
        check_block_hash(lambda parent, tokens: hash(tuple(tokens)))
    with pytest.raises(CheckFailed, match="order"):
        check_block_hash(lambda parent, tokens: hash((parent, sum(tokens))))


def test_wrong_allocators_fail():
    def release_ignoring_refs(bm, block_id):
        bm.blocks[block_id].ref_count = 0
        bm.free_ids.append(block_id)

    with pytest.raises(CheckFailed, match="shared by two sequences"):
        check_block_allocation(take_free_block, release_ignoring_refs)

    def release_without_cache(bm, block_id):
        block = bm.blocks[block_id]
        if block.ref_count == 0:
            raise RuntimeError("double free")
        block.ref_count -= 1
        if block.ref_count == 0:
            bm.free_ids.append(block_id)

    with pytest.raises(CheckFailed, match="evictable"):
        check_block_allocation(take_free_block, release_without_cache)


def test_static_scheduler_fails_the_continuous_check():
    def static_like(scheduler):
        if scheduler.running:
            out = SchedulerOutput()
            budget = scheduler.max_num_batched_tokens
            for seq in scheduler.running_in_order():
                if seq.status is SequenceStatus.RUNNING and budget:
                    n = scheduler.tokens_to_run(seq, budget, out)
                    if n and scheduler.reserve(seq, n, out):
                        budget -= n
            return out
        return schedule_continuous(scheduler)

    with pytest.raises(CheckFailed, match="static batching"):
        check_continuous_schedule(static_like)


def test_scheduler_forgetting_decodes_is_caught():
    def admit_only(scheduler):
        out = SchedulerOutput()
        for seq in scheduler.waiting_in_order():
            if not scheduler.try_admit(seq, scheduler.max_num_batched_tokens - out.num_tokens, out):
                break
        return out

    with pytest.raises(CheckFailed):
        check_continuous_schedule(admit_only)
