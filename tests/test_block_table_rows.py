"""The runner's block tables, kept as tensor rows updated by what changed.

Each case mutates block-manager-style lists the ways the engine does — appending, copy-on-write
of the block a chunk writes into, rolling back, releasing behind a sliding window, replacing the
list (preemption), reusing a request id, evicting rows — and the gathered tensor must equal the
lists padded with the null block. A decode step must write one entry per sequence at most,
however many blocks the sequences hold. (Every engine test also runs with ``verify`` on:
``tests/conftest.py``.)
"""

from __future__ import annotations

import random

import torch

from minillm.kvcache.addressing import RELEASED, padded_block_tables
from minillm.runtime.block_table_rows import BlockTableRows
from minillm.runtime.runner import ChunkInput

NULL, BS = 0, 4


def expected(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor(padded_block_tables(tables, width, NULL))


def chunk(rid, table, start, n=1):
    return ChunkInput(rid, [1] * n, start, 1, table)


def test_gathers_rows_in_step_order_padded_and_cut_to_width():
    rows = BlockTableRows(NULL, BS)
    a, b = [5, 6, 7], [9]
    got = rows.gather([chunk("b", b, 2), chunk("a", a, 10)], width=4)
    assert torch.equal(got, expected([b, a], 4))
    assert torch.equal(rows.gather([chunk("a", a, 11)], width=2), expected([a], 2))


def test_every_mutation_the_engine_makes_is_followed():
    rows = BlockTableRows(NULL, BS)
    t = [3, 4]
    rows.gather([chunk("s", t, 7)], 2)
    t.append(8)  # a new block for the next token
    assert torch.equal(rows.gather([chunk("s", t, 8)], 3), expected([t], 3))
    t[2] = 11  # copy-on-write of the block the chunk writes into (a shared partial block)
    assert torch.equal(rows.gather([chunk("s", t, 9)], 3), expected([t], 3))
    t[0] = RELEASED  # fell behind a sliding window
    assert torch.equal(rows.gather([chunk("s", t, 10)], 3), expected([t], 3))
    del t[2:]  # a speculative rollback to 6 tokens
    assert torch.equal(rows.gather([chunk("s", t, 6)], 3), expected([t], 3))
    t.extend([12, 13])  # drafts written again, into new blocks
    assert torch.equal(rows.gather([chunk("s", t, 6, n=5)], 4), expected([t], 4))
    fresh = [20, 21]  # preempted and admitted again: a new list
    assert torch.equal(rows.gather([chunk("s", fresh, 7)], 4), expected([fresh], 4))


def test_a_released_row_or_an_evicted_one_is_rebuilt_whole():
    rows = BlockTableRows(NULL, BS, max_rows=2)
    long = list(range(1, 40))
    rows.gather([chunk("x", long, 150)], 39)
    rows.release("x")
    short = [7]  # another request takes the freed row: the old entries must not show through
    assert torch.equal(rows.gather([chunk("y", short, 1)], 39), expected([short], 39))
    for rid in ("p", "q", "r"):  # over max_rows: the least recently used ("y") is dropped
        rows.gather([chunk(rid, [2, 3], 5)], 2)
    assert "y" not in rows.rows and len(rows.rows) == 2
    assert torch.equal(rows.gather([chunk("y", short, 2)], 2), expected([short], 2))


def test_growing_beyond_the_first_tensor_keeps_every_row():
    rows = BlockTableRows(NULL, BS)
    tables = {i: list(range(100 * i + 1, 100 * i + 1 + i % 7 + 1)) for i in range(40)}  # > 16 rows
    rows.gather([chunk(i, t, 0) for i, t in tables.items()], 8)
    tables[3] += list(range(900, 990))  # > 64 columns
    got = rows.gather([chunk(i, t, 0) for i, t in tables.items()], 95)
    assert torch.equal(got, expected(list(tables.values()), 95))


def test_a_decode_step_writes_one_entry_per_sequence_whatever_the_blocks():
    """The point of the class: 64 sequences of 500 blocks, and each decode step writes at most
    one entry per sequence (the block the new token goes in), not 32,000."""
    rows = BlockTableRows(NULL, BS)
    tables = {i: list(range(1000 * i + 1, 1000 * i + 501)) for i in range(64)}
    lengths = {i: 500 * BS - 3 for i in tables}
    writes = []
    for step in range(10):
        chunks = [chunk(i, t, lengths[i] - 1) for i, t in tables.items()]
        got = rows.gather(chunks, 501)
        writes.append(rows.last_writes)
        assert torch.equal(got, expected(list(tables.values()), 501))
        for i, t in tables.items():
            lengths[i] += 1
            if lengths[i] > len(t) * BS:
                t.append(100_000 + 100 * i + step)
    assert writes[0] == 64 * 500  # the first step writes the tables whole
    assert 0 < max(writes[1:]) <= 64


def test_random_mutations_match_the_lists():
    rng = random.Random(0)
    rows = BlockTableRows(NULL, BS, max_rows=6)
    tables: dict[int, list[int]] = {}
    for _ in range(300):
        rid = rng.randrange(10)
        t = tables.setdefault(rid, [rng.randrange(1, 99)])
        action = rng.random()
        start = max(0, len(t) * BS - 2)
        if action < 0.4:
            t.append(rng.randrange(1, 99))
            start = (len(t) - 1) * BS
        elif action < 0.55:  # copy-on-write of the block the chunk starts in (never one released)
            first_live = next((j for j, b in enumerate(t) if b != RELEASED), len(t) - 1)
            start = rng.randrange(first_live, len(t)) * BS
            t[start // BS] = rng.randrange(1, 99)
        elif action < 0.7 and len(t) > 1:
            keep = rng.randrange(1, len(t))
            del t[keep:]
            start = (keep - 1) * BS
        elif action < 0.8:
            first_live = next((j for j, b in enumerate(t) if b != RELEASED), len(t))
            if first_live < len(t) - 1:
                t[first_live] = RELEASED
        elif action < 0.9:
            tables[rid] = t = list(t)  # a new list with the same blocks
        else:
            rows.release(rid)
        width = max(len(t), 1)
        assert torch.equal(rows.gather([chunk(rid, t, start)], width), expected([t], width))


def test_an_unchanged_row_writes_nothing_and_a_regrown_one_is_caught():
    """Most decode steps change no table: nothing is written. A table rolled back and grown to
    its old length again (rejected proposals, then new blocks) has the same length but other
    blocks after the chunk's first one: those must be written."""
    rows = BlockTableRows(NULL, BS)
    t = [3, 4, 5]
    rows.gather([chunk("s", t, 9)], 3)
    rows.gather([chunk("s", t, 10)], 3)
    assert rows.last_writes == 0
    del t[2:]  # rolled back to 6 tokens ...
    t.append(9)  # ... and a new block for the next verify chunk: same length, the last entry new
    got = rows.gather([chunk("s", t, 5, n=5)], 3)  # its first block (4) is unchanged
    assert torch.equal(got, expected([t], 3)) and rows.last_writes == 2
