"""Block tables as rows of one persistent tensor, updated by what changed since the last step.

The block manager keeps each sequence's block table as a Python list; a step's attention wants
the step's tables as one tensor ``[rows, width]`` padded with the null block. Rebuilding that
from the lists every step is Python work proportional to every block of every running sequence
— 64 sequences of 8,000 tokens in blocks of 16 are 32,000 list entries per step — although a
decode step changes at most one entry per sequence. Here each sequence owns a row of one tensor,
and a step writes only the entries that can have changed since that row was last written:

- from the block the chunk starts writing in to the table's end: copy-on-write replaces only
  that block (``BlockManager.allocate_slots``), and new blocks are appended after it;
- the entries released behind a sliding window (a growing prefix of ``RELEASED``) become the
  null block; entries past a table that shrank (a speculative rollback) too;
- a table that is another list object — a preempted sequence admitted again, a request id
  reused, tables that came from another process — is written whole.

So a decode step costs Python work per sequence, not per block, and one tensor indexing call
gathers the rows. Most decode steps change nothing at all (a new block is needed once every
``block_size`` tokens): each row keeps a Python mirror of what its tensor row holds, and a row
whose list still matches it from the chunk's first block on costs one short list comparison and
no write. ``verify`` (the test suite turns it on) compares every row with its list
after each update, so a change to the block manager that breaks these rules fails loudly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from minillm.kvcache.addressing import RELEASED
from minillm.runtime.runner import ChunkInput, long_tensor


@dataclass
class _Row:
    index: int  # the row of the tensor
    source: list[int]  # the block manager's list this row mirrors
    released: int  # leading entries known to be RELEASED (already the null block here)
    written: list[int]  # what the tensor row holds now (released entries as the null block)


class BlockTableRows:
    """The runner's copy of the running sequences' block tables (see the module docstring)."""

    verify = False  # check every row against its list after each update (tests)

    def __init__(self, null_block: int, block_size: int, max_rows: int = 1024):
        """``max_rows``: rows kept for sequences not in the current step before the least
        recently used are dropped (a dropped sequence's row is written whole when it returns)."""
        self.null_block, self.block_size, self.max_rows = null_block, block_size, max_rows
        self.table = torch.full((16, 64), null_block, dtype=torch.long)
        self.rows: OrderedDict[Hashable, _Row] = OrderedDict()  # least recently used first
        self.free_rows = list(range(16))[::-1]
        self.stale: list[list[int]] = [[] for _ in range(16)]  # per tensor row: what a dropped row left there
        self.last_writes = 0  # entries the last gather wrote (tests and benchmarks read it)

    def gather(self, chunks: list[ChunkInput], width: int) -> torch.Tensor:
        """``[len(chunks), width]`` block tables of ``chunks``' sequences, in their order,
        padded (and released entries replaced) with the null block."""
        self._grow(len(self.rows) + len(chunks), max([width, *(len(c.block_table) for c in chunks)]))
        rows, cols, values = [], [], []
        indices = [self._update(c, rows, cols, values) for c in chunks]
        self.last_writes = len(values)
        if values:
            self.table.index_put_((long_tensor(rows), long_tensor(cols)), long_tensor(values))
        if self.verify:
            self._check(chunks)
        self._evict(keep=len(chunks))
        return self.table[long_tensor(indices), :width]

    def release(self, request_id: Hashable) -> None:
        """The sequence finished: its row is free for another."""
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._free(row)

    def _free(self, row: _Row) -> None:
        self.stale[row.index] = row.written  # entries the next owner of the row must overwrite
        self.free_rows.append(row.index)

    def _update(self, chunk: ChunkInput, rows: list, cols: list, values: list) -> int:
        """Queue the writes that bring ``chunk``'s row up to date; returns the row's index."""
        table = chunk.block_table
        row = self.rows.get(chunk.request_id)
        if row is None:
            i = self.free_rows.pop()
            row = self.rows[chunk.request_id] = _Row(i, [], 0, self.stale[i])
            self.stale[i] = []
        self.rows.move_to_end(chunk.request_id)
        i, n, written = row.index, len(table), row.written
        first = chunk.start // self.block_size  # nothing before it changes, but for releases
        if row.source is table:
            if (
                n == len(written)
                and table[first:] == written[first:]
                and (row.released == n or table[row.released] != RELEASED)
            ):
                return i  # unchanged since it was written: most decode steps
            first = min(len(written), first)  # copy-on-write, appended blocks
        else:  # written whole (a new row's list is a fresh object too)
            row.source, row.released, first = table, 0, 0
        null = self.null_block
        row.released = min(row.released, n)  # a rollback may cut into the released prefix
        for j in range(first, n):
            rows.append(i), cols.append(j), values.append(table[j] if table[j] >= 0 else null)
        for j in range(n, len(written)):  # a shorter table than this row held
            rows.append(i), cols.append(j), values.append(null)
        written[first:] = [b if b >= 0 else null for b in table[first:]]
        while row.released < n and table[row.released] == RELEASED:  # fell behind a sliding window
            rows.append(i), cols.append(row.released), values.append(null)
            written[row.released] = null
            row.released += 1
        return i

    def _grow(self, num_rows: int, num_cols: int) -> None:
        """Room for ``num_rows`` rows of ``num_cols`` entries (doubling, so growth is rare)."""
        have_rows, have_cols = self.table.shape
        if num_rows <= have_rows and num_cols <= have_cols:
            return
        rows, cols = have_rows, have_cols
        while rows < num_rows:
            rows *= 2
        while cols < num_cols:
            cols *= 2
        grown = torch.full((rows, cols), self.null_block, dtype=torch.long)
        grown[:have_rows, :have_cols] = self.table
        self.table = grown
        self.free_rows = list(range(have_rows, rows))[::-1] + self.free_rows
        self.stale += [[] for _ in range(rows - have_rows)]

    def _evict(self, keep: int) -> None:
        """Drop the least recently used rows beyond ``max_rows`` (never this step's ``keep``)."""
        while len(self.rows) > max(self.max_rows, keep):
            _, row = self.rows.popitem(last=False)
            self._free(row)

    def _check(self, chunks: list[ChunkInput]) -> None:
        for c in chunks:
            row = self.rows[c.request_id]
            expected = [b if b >= 0 else self.null_block for b in c.block_table]
            got = self.table[row.index].tolist()
            if got[: len(expected)] != expected or any(b != self.null_block for b in got[len(expected) :]):
                raise AssertionError(f"block table row of {c.request_id!r} is stale: {got} vs {c.block_table}")
