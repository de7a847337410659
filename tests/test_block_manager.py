"""Block manager: allocation, reference counts, prefix caching, copy-on-write, eviction.

The property test drives random interleavings of add / grow / speculate-and-roll-back / fork /
free and checks every invariant after every operation: no leak, no double free, exact
reference counts, statistics counters equal to a walk over every table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from minillm.kvcache.block_manager import BlockManager, block_hash


@dataclass
class Seq:
    request_id: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def run_tokens(bm: BlockManager, seq: Seq, n: int):
    """Allocate for and 'compute' the next ``n`` tokens of ``seq``, as the engine does."""
    copies = bm.allocate_slots(seq, n)
    if copies is None:
        return None
    seq.num_computed_tokens += n
    bm.commit(seq)
    return copies


def test_blocks_are_allocated_on_demand_and_freed():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(0, list(range(10)))
    assert bm.match_prefix(seq) == 0
    assert run_tokens(bm, seq, 10) == []
    assert len(bm.tables[0]) == 3  # 10 tokens in blocks of 4
    assert bm.num_used_blocks == 3 and bm.wasted_slots() == 2
    seq.token_ids.append(10)
    run_tokens(bm, seq, 1)
    assert len(bm.tables[0]) == 3 and bm.wasted_slots() == 1  # the 11th token fits the last block
    seq.token_ids += [11, 12]
    run_tokens(bm, seq, 2)
    assert len(bm.tables[0]) == 4
    bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_prefix_is_reused_and_hash_is_chained():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(0, list(range(10)))
    bm.match_prefix(a)
    run_tokens(bm, a, 10)
    # Same first 8 tokens: two full blocks reused, their K/V not recomputed.
    b = Seq(1, list(range(8)) + [99, 98, 97])
    assert bm.match_prefix(b) == 8
    assert bm.tables[1][:2] == bm.tables[0][:2]
    assert bm.blocks[bm.tables[0][0]].ref_count == 2
    # Same tokens 4..7 after a different first block: not the same prefix, no reuse.
    c = Seq(2, [50, 51, 52, 53] + list(range(4, 8)) + [1])
    assert bm.match_prefix(c) == 0
    assert block_hash(None, [0, 1, 2, 3]) == block_hash(None, (0, 1, 2, 3))  # stable
    assert block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7]) != block_hash(None, [4, 5, 6, 7])
    bm.check_invariants()


def test_finished_prefix_stays_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Seq(0, [1, 2, 3, 4, 5])
    bm.match_prefix(a)
    run_tokens(bm, a, 5)
    bm.free(a)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4  # cached blocks are still allocatable
    again = Seq(1, [1, 2, 3, 4, 9])
    assert bm.match_prefix(again) == 4  # served from the cache after its owner finished
    bm.free(again)
    # Fill the pool: the cached blocks are evicted (tail of the prefix first), never the used ones.
    big = Seq(2, list(range(100, 107)))
    bm.match_prefix(big)
    assert run_tokens(bm, big, 7) == []
    assert bm.num_cached_blocks == 0
    bm.check_invariants()
    assert bm.match_prefix(Seq(3, [1, 2, 3, 4, 9])) == 0


def test_whole_prompt_cached_recomputes_last_token_with_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(0, list(range(8)))
    bm.match_prefix(a)
    run_tokens(bm, a, 8)
    b = Seq(1, list(range(8)))
    assert bm.match_prefix(b) == 7  # the last token is always computed: it yields the logits
    shared = bm.tables[1][1]
    copies = run_tokens(bm, b, 1)
    assert copies == [(shared, bm.tables[1][1])] and bm.tables[1][1] != shared
    assert bm.blocks[shared].ref_count == 1
    bm.check_invariants()


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Seq(0, list(range(6)))
    bm.match_prefix(parent)
    run_tokens(bm, parent, 6)
    child = Seq(1, list(range(6)))
    bm.fork(parent, child)
    assert bm.tables[1] == bm.tables[0]
    child.token_ids.append(42)
    copies = run_tokens(bm, child, 1)  # writes into the shared, half-full second block
    assert len(copies) == 1 and copies[0][0] == bm.tables[0][1] and bm.tables[1][1] != bm.tables[0][1]
    assert bm.tables[1][0] == bm.tables[0][0]  # the full first block stays shared
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Seq(0, list(range(12)))
    bm.match_prefix(seq)
    assert bm.allocate_slots(seq, 12) is None
    assert bm.tables[0] == [] and bm.num_free_blocks == 2
    bm.cancel_prefix(seq)
    bm.check_invariants()
    assert bm.prefix_queries == 0


def test_double_free_and_misuse_are_reported():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Seq(0, [1, 2, 3])
    bm.match_prefix(seq)
    run_tokens(bm, seq, 3)
    bm.free(seq)
    with pytest.raises(RuntimeError, match="no blocks to free"):
        bm.free(seq)
    with pytest.raises(RuntimeError, match="no block table"):
        bm.allocate_slots(Seq(5, [1]), 1)


@pytest.mark.parametrize(
    ("kwargs", "message"), [(dict(block_size=0), "block_size=0"), (dict(num_blocks=0), "num_blocks=0")]
)
def test_invalid_sizes(kwargs, message):
    args = dict(num_blocks=4, block_size=4) | kwargs
    with pytest.raises(ValueError, match=message):
        BlockManager(**args)


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_keep_every_invariant(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=rng.choice([1, 2, 4]), enable_prefix_caching=seed % 3 != 0)
    live: list[Seq] = []
    next_id = 0
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]  # shared beginnings
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not live:  # add: a prompt that may share a prefix
            tokens = list(rng.choice(prefixes)[: rng.randrange(13)]) + [
                rng.randrange(5) for _ in range(rng.randrange(1, 6))
            ]
            seq = Seq(next_id, tokens)
            next_id += 1
            bm.match_prefix(seq)
            if run_tokens(bm, seq, len(tokens) - seq.num_computed_tokens) is None:
                bm.cancel_prefix(seq)
            else:
                live.append(seq)
        elif op < 0.5:  # grow by one decoded token
            seq = rng.choice(live)
            seq.token_ids.append(rng.randrange(5))
            if run_tokens(bm, seq, 1) is None:
                seq.token_ids.pop()
        elif op < 0.65:  # speculate: write k tokens in one step, then keep only some of them
            seq = rng.choice(live)
            k = rng.randrange(1, 5)
            seq.token_ids += [rng.randrange(5) for _ in range(k)]
            if run_tokens(bm, seq, k) is None:
                del seq.token_ids[-k:]
            else:
                keep = len(seq.token_ids) - rng.randrange(k + 1)
                bm.truncate(seq, keep)
                del seq.token_ids[keep:]
                assert seq.num_computed_tokens == keep
        elif op < 0.78:  # fork
            parent = rng.choice(live)
            child = Seq(next_id, list(parent.token_ids))
            next_id += 1
            bm.fork(parent, child)
            live.append(child)
        else:  # free
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants()
        # Every live sequence's table covers exactly its computed tokens.
        for seq in live:
            assert len(bm.tables[seq.request_id]) == bm.blocks_for(seq.num_computed_tokens)
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_truncate_frees_blocks_and_forgets_partial_hashes():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(0, list(range(10)))
    bm.match_prefix(seq)
    run_tokens(bm, seq, 10)  # blocks: [0..3] [4..7] [8, 9]
    assert len(bm.tables[0]) == 3 and len(bm.cached) == 2
    assert bm.truncate(seq, 6) == 1  # the third block goes; the second is no longer full
    assert len(bm.tables[0]) == 2 and seq.num_computed_tokens == 6
    assert len(bm.cached) == 1 and bm.blocks[bm.tables[0][1]].hash is None
    assert bm.wasted_slots() == 2 and bm.num_reserved_tokens == 6
    bm.check_invariants()
    # Growing again after the rollback writes the new tokens and re-registers the full block.
    seq.token_ids = seq.token_ids[:6] + [70, 71]
    run_tokens(bm, seq, 2)
    assert len(bm.cached) == 2
    other = Seq(1, [0, 1, 2, 3, 4, 5, 6, 7, 9])  # the old second block's content: not a hit any more
    assert bm.match_prefix(other) == 4
    bm.check_invariants()


def test_truncate_keeps_a_shared_blocks_hash_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(0, list(range(8)))
    bm.match_prefix(a)
    run_tokens(bm, a, 8)
    b = Seq(1, list(range(8)) + [9])
    assert bm.match_prefix(b) == 8
    run_tokens(bm, b, 1)
    shared = bm.tables[1][1]
    bm.truncate(b, 6)  # into a block that `a` still holds full
    assert bm.blocks[shared].hash is not None and bm.tables[1] == bm.tables[0]
    b.token_ids = b.token_ids[:6] + [60]
    copies = bm.allocate_slots(b, 1)
    assert copies and copies[0][0] == shared and bm.tables[1][1] != shared  # written privately
    bm.check_invariants()


@pytest.mark.parametrize("bad", [-1, 11, 2.0, True])
def test_truncate_rejects_bad_lengths(bad):
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(0, list(range(10)))
    bm.match_prefix(seq)
    run_tokens(bm, seq, 10)
    with pytest.raises(ValueError, match="truncate: num_tokens="):
        bm.truncate(seq, bad)
    with pytest.raises(RuntimeError, match="no blocks to truncate"):
        bm.truncate(Seq(5), 0)
    bm.check_invariants()


def test_truncate_refuses_to_roll_back_into_released_window_blocks():
    from minillm.kvcache.block_manager import RELEASED

    bm = BlockManager(num_blocks=16, block_size=4)
    seq = Seq(0, list(range(20)))
    bm.match_prefix(seq)
    run_tokens(bm, seq, 20)
    bm.release_behind_window(seq, 8)  # the next query (position 20) sees keys 13..20: blocks 0-2 go
    assert bm.tables[0][:3] == [RELEASED] * 3
    for back_to in (10, 18):  # the next query at 18 would see keys 11..18: key 11 was in block 2
        with pytest.raises(ValueError, match="released behind the sliding window"):
            bm.truncate(seq, back_to, window=8)
    assert bm.truncate(seq, 19, window=8) == 0  # keys 12..19: blocks 3 and 4, still there
    assert seq.num_computed_tokens == 19
    bm.check_invariants()


def test_block_hash_is_the_same_in_every_process():
    """Prefix-cache names must agree between processes (workers sharing a cache, a restart):
    the built-in hash() of a tuple holding None differs per process before Python 3.12."""
    import os
    import subprocess
    import sys

    from minillm.kvcache.block_manager import block_hash

    code = (
        "from minillm.kvcache.block_manager import block_hash;"
        "a = block_hash(None, [1, 2, 3, 4]); print(a, block_hash(a, [5, 6, 7, 8]))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.split()[0:2]
        .__repr__()
        for seed in ("1", "2", "random")
    }
    here = block_hash(None, [1, 2, 3, 4])
    assert outputs == {repr([str(here), str(block_hash(here, [5, 6, 7, 8]))])}
    assert block_hash(None, [1, 2]) != block_hash(0, [1, 2])  # "no parent" is not parent 0
