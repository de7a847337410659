"""Chapter 03's block-table exercise: ``grow_table`` (a sequence's table grown for its new tokens,
a shared block copied before it is written) and ``slot_mapping`` (where each new token's K/V go).

``grow_table`` is diagnosed on hand-made tables with a pool made here (``FakePool``: it hands out
block ids in order, counts references and records every ``take`` and ``release``), and compared
call by call with the package's on the same table — what it returns, the table afterwards, the
blocks taken and released — so a failure names the first thing that differs. Then both functions
run inside the paged engine: greedy requests through a scattered pool (against the contiguous
cache), and sampled requests with two samples each, whose forked block tables share blocks until
one sample writes (against the package's engine, seed for seed).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.checks.engines import PROMPTS, paged_engine, run_scattered
from minillm.course.results import CheckError, CheckFailed, check, time_limit

LIMIT_S = 5.0  # one hand-made call takes microseconds: a loop that never ends is cut off


class FakePool:
    """Block ids handed out in order from ``first``, reference counts, and a log of the calls."""

    def __init__(self, refs: dict[int, int], first: int = 20):
        self.refs = dict(refs)
        self.next = first
        self.taken: list[int] = []
        self.released: list[int] = []

    def ref_count(self, block: int) -> int:
        return self.refs.get(block, 0)

    def take(self) -> int:
        block, self.next = self.next, self.next + 1
        self.refs[block] = 1
        self.taken.append(block)
        return block

    def release(self, block: int) -> None:
        if self.refs.get(block, 0) < 1:
            raise CheckFailed(f"grow_table released block {block}, which the table no longer held a reference to")
        self.refs[block] -= 1
        self.released.append(block)


@dataclass
class Case:
    what: str
    table: list[int]
    num_computed: int
    num_new: int
    refs: dict[int, int]
    block_size: int = 4


CASES = [
    Case("a new sequence's 10-token prompt", [], 0, 10, {}),
    Case("a decode at position 8, where block 2 begins", [7, 8], 8, 1, {7: 1, 8: 1}),
    Case("a decode at position 7, inside block 1", [7, 8], 7, 1, {7: 1, 8: 1}),
    Case("a chunk of 9 tokens from position 5", [7, 8], 5, 9, {7: 1, 8: 1}),
    Case("a decode at position 6, into block 8 that a forked sample shares", [7, 8], 6, 1, {7: 2, 8: 2}),
    Case("a 5-token chunk from position 6, block 8 shared", [7, 8], 6, 5, {7: 2, 8: 2}),
    Case("a decode at position 8, after the shared blocks 7 and 8", [7, 8], 8, 1, {7: 2, 8: 2}),
    Case("a decode at position 5 into block 8; only the earlier block 7 is shared", [7, 8], 5, 1, {7: 3, 8: 1}),
    Case("block size 16: 20 tokens from position 0", [], 0, 20, {}, 16),
    Case("nothing new (num_new = 0)", [7, 8], 6, 0, {7: 1, 8: 2}),
]


def _run(fn, case: Case):
    pool = FakePool(case.refs)
    table = list(case.table)
    stuck = (
        f"grow_table({case.table}, num_computed={case.num_computed}, num_new={case.num_new}, block_size="
        f"{case.block_size}) did not return within {LIMIT_S:g} s: does every turn of its loop add a block to the table?"
    )
    with time_limit(LIMIT_S, stuck):
        got = fn(table, case.num_computed, case.num_new, case.block_size, pool.ref_count, pool.take, pool.release)
    return got, table, pool


def _diagnose(grow_table, case: Case) -> None:
    got, table, pool = _run(grow_table, case)
    want, want_table, ref = _run(hooks.default("grow_table"), case)
    call = (
        f"grow_table({case.table}, num_computed={case.num_computed}, num_new={case.num_new}, "
        f"block_size={case.block_size}) — {case.what}"
    )
    end, first = case.num_computed + case.num_new, case.num_computed // case.block_size
    need = -(-end // case.block_size)
    if table == case.table and want_table != case.table and isinstance(got, list) and got and isinstance(got[0], int):
        raise CheckFailed(
            f"{call}: returned a list of blocks and left the table as it was — grow the table in place "
            "(table.append(...), table[i] = ...): the block manager keeps that very list. Return the copies"
        )
    if not isinstance(got, list) or any(not (isinstance(c, tuple) and len(c) == 2) for c in got):
        raise CheckFailed(
            f"{call}: returned {got!r:.80}; return the list of (src, dst) block copies ([] when no shared block is "
            "written)"
        )
    if len(table) != len(want_table):
        fix = (
            f"positions 0 .. {end - 1} need ceil({end} / {case.block_size}) = {need} blocks"
            if end
            else "there is nothing to add"
        )
        raise CheckFailed(f"{call}: the table has {len(table)} blocks afterwards, expected {len(want_table)}: {fix}")
    if want and not got:
        shared = case.table[first]
        raise CheckFailed(
            f"{call}: the first new token goes into block {shared} (table[{first}]), which "
            f"{case.refs[shared]} tables hold: writing into it would change the other sequence's K/V. Take a "
            f"private block, return the copy ({shared}, private) and put the private block in the table"
        )
    extra = [c for c in got if c[0] not in {w[0] for w in want}] if all(len(c) == 2 for c in got) else []
    if extra and not [w for w in want if w[0] not in {c[0] for c in got}]:
        src = extra[0][0]
        why = (
            f"block {src} is not shared (ref_count {case.refs.get(src, 0)})"
            if case.refs.get(src, 0) < 2
            else f"no new token is written into block {src}: only the block of the first new token, table[{first}], "
            "can need a copy"
        )
        expected = f"expected {want}" if want else "expected none"
        raise CheckFailed(f"{call}: returned the copies {got}, {expected}: {why}")
    if got != want:
        if got == [(dst, src) for src, dst in want]:
            raise CheckFailed(f"{call}: returned {got}: a copy goes (src, dst) = (shared block, private copy)")
        raise CheckFailed(f"{call}: returned the copies {got}, expected {want} (src, dst)")
    if pool.released != ref.released:
        if not pool.released:
            raise CheckFailed(
                f"{call}: the table now holds the private copy but still counts a reference to shared block "
                f"{want[0][0]}: release(shared) once the copy replaces it (or it never returns to the pool)"
            )
        raise CheckFailed(f"{call}: released blocks {pool.released}, expected {ref.released}")
    if len(pool.taken) != len(ref.taken):
        raise CheckFailed(
            f"{call}: took {len(pool.taken)} blocks from the pool, expected {len(ref.taken)}: every block taken must "
            "end up in the table (a block taken and dropped is lost to every sequence)"
        )
    if table != want_table:
        raise CheckFailed(
            f"{call}: the table is {table} afterwards, expected {want_table} (blocks are taken in order 20, 21, ...): "
            "the private copy replaces the shared block at its place, and new blocks go at the end"
        )


def _slots_of(table: list[int], positions, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _slot_mapping_mistake(got: list, table: list[int], start: int, num_tokens: int, block_size: int) -> str:
    """Name what a wrong slot mapping did: which positions its slots belong to, a constant block
    size, or, at the first wrong position, a wrong block or a wrong offset."""
    odd = next((s for s in got if isinstance(s, bool) or not isinstance(s, numbers.Integral)), None)
    if odd is not None:
        return f"the slots must be Python ints, and {odd!r} is a {type(odd).__name__}"
    got = [int(s) for s in got]
    expected = _slots_of(table, range(start, start + num_tokens), block_size)
    position_of = {s: p for p, s in enumerate(_slots_of(table, range(len(table) * block_size), block_size))}
    positions = [position_of.get(s) for s in got]
    if got and None not in positions and positions == list(range(positions[0], positions[0] + len(got))):
        if len(got) != num_tokens or positions[0] != start:
            span = f"positions {positions[0]}-{positions[-1]}" if len(got) > 1 else f"position {positions[0]} only"
            return (
                f"those are the slots of {span}; the call asks for the "
                f"num_tokens={num_tokens} positions start .. start + num_tokens - 1 = {start}-{start + num_tokens - 1}"
            )
    if len(got) != num_tokens:
        return f"that is {len(got)} slots for num_tokens={num_tokens}: one slot per position"
    for other in range(1, 65):
        try:
            if other != block_size and got == _slots_of(table, range(start, start + num_tokens), other):
                return f"those are the slots for block_size={other}: use the block_size argument, not a constant"
        except IndexError:
            continue
    i = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
    p, g, e = start + i, got[i], expected[i]
    block = table[p // block_size]
    where = (
        f"position {p} lives at offset {p} % {block_size} = {p % block_size} of block block_table[{p} // {block_size}] "
        f"= {block}, slot {e}; you gave slot {g}"
    )
    if g == block + p % block_size:
        return f"{where}: you added the offset to the block id; block {block} starts at slot {block} * block_size"
    if g == block * block_size + p:
        return f"{where}: you added the position itself; add its offset inside the block, p % block_size"
    if i and g == got[i - 1] + 1 and p % block_size == 0:
        return (
            f"{where}, the slot after position {p - 1}'s: position {p} starts a new block, and a sequence's blocks "
            "are not adjacent in the pool; look each position's block up in the table"
        )
    if g // block_size == block:
        return f"{where}: the right block, the wrong offset (p % block_size)"
    if g % block_size == p % block_size and g // block_size in table:
        j = table.index(g // block_size)
        return (
            f"{where}: the right offset in the wrong block, block_table[{j}] instead of block_table[{p // block_size}] "
            "(the block index is p // block_size, rounded down)"
        )
    return where


def _diagnose_slots(slot_mapping) -> None:
    table = [7, 2, 9]
    given = list(table)
    got = slot_mapping(given, 3, 4, 4)  # positions 3, 4, 5, 6 in blocks of 4
    expected = [31, 8, 9, 10]
    if given != table:
        raise CheckFailed(
            f"slot_mapping changed the block table it was given, from {table} to {given}: the table belongs to "
            "the block manager (the engine reuses it every step); read it, never write to it"
        )
    if got == [3, 4, 5, 6]:
        raise CheckFailed(
            "slot_mapping returned the positions themselves: position p lives in block "
            "block_table[p // block_size], so its slot is block_table[p // block_size] * block_size + p % block_size"
        )
    if got == [3, 0, 1, 2]:
        raise CheckFailed("slot_mapping returned offsets inside blocks; add block_table[p // block_size] * block_size")
    call = f"slot_mapping({table}, start=3, num_tokens=4, block_size=4)"
    if not isinstance(got, list):
        raise CheckFailed(
            f"{call} returned a {type(got).__name__}, {got!r:.60}; return a list of Python ints, expected {expected}"
        )
    if got != expected:
        raise CheckFailed(f"{call} returned {got!r}, expected {expected}: {_slot_mapping_mistake(got, table, 3, 4, 4)}")


def _forked_tokens(model: str, grow_table=None) -> tuple[list[list[int]], int]:
    """Two samples per prompt (their tables share the prompt's blocks), seed for seed; the copies made."""
    from minillm import SamplingParams

    engine = paged_engine(model, block_size=4)
    engine.block_manager.free_ids.rotate(5)  # a scattered pool: a sequence's blocks are not adjacent
    copies = []
    package = hooks.default("grow_table")

    def counted(*args):
        out = (grow_table or package)(*args)
        copies.extend(out if isinstance(out, list) else [])
        return out

    params = SamplingParams(max_tokens=12, n=2, temperature=0.9, seed=11, ignore_eos=True)
    with hooks.override(grow_table=counted):
        ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
        done = {}
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            for d in engine.step():
                if d.output is not None:
                    done[d.request_id] = d.output
    return [list(s.token_ids) for i in ids for s in done[i].samples], len(copies)


@check
def check_block_table(grow_table, slot_mapping, model: str = DEFAULT_MODEL) -> str:
    """``grow_table(table, num_computed, num_new, block_size, ref_count, take, release) -> copies`` and
    ``slot_mapping(block_table, start, num_tokens, block_size) -> list[int]``."""
    for case in CASES:
        _diagnose(grow_table, case)
    _diagnose_slots(slot_mapping)
    run_scattered(
        model,
        {"grow_table": grow_table, "slot_mapping": slot_mapping},
        "the engine growing block tables with your grow_table and writing K/V through your slot mapping",
        "check positions that cross a block boundary",
    )
    expected, package_copies = _forked_tokens(model)
    got, copies = _forked_tokens(model, grow_table)
    if not package_copies:
        raise CheckError("the forked samples were meant to share blocks, but nothing was copied on write")
    for n, (mine, ref) in enumerate(zip(got, expected)):
        if mine != ref:
            raise CheckFailed(
                f"with two samples per prompt, sample {n % 2} of prompt {n // 2} differs from the package's engine "
                f"(seed for seed): its tokens are written into blocks its twin shares — copy the shared block first"
            )
    return (
        f"the paged engine grew every block table with your grow_table ({copies} copies on write for forked "
        f"samples) and wrote every K/V through your slot mapping: {len(PROMPTS)} greedy requests match the "
        "contiguous cache, 6 sampled ones the package's engine"
    )
