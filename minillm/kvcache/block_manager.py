"""The block manager: who owns which slots of the paged KV pool.

The contiguous cache reserves ``max_len`` slots per sequence up front, used or not. Paging
(as an operating system pages memory) cuts the pool into fixed-size **blocks** of
``block_size`` token slots and hands them out on demand: a sequence's **block table** lists
its blocks in order, so token ``i`` lives in block ``table[i // block_size]`` at offset
``i % block_size``. At most one partly filled block per sequence is wasted.

Blocks carry a **reference count**, so several sequences can share one:

- **Prefix caching.** When a block fills up, we name it by a hash of its token ids chained
  with its parent block's hash — the hash of block ``j`` therefore identifies the whole
  prefix ``0 .. (j+1)*block_size``. A new request whose prompt starts with the same tokens
  finds those blocks by hash and reuses their K/V without recomputing them. A finished
  request's hashed blocks stay in the pool, unreferenced but intact, and are evicted (least
  recently used first) only when the pool runs short.
- **Forking** (several samples of one prompt) copies a block table and bumps the counts; a
  shared block is **copied on write**: the sequence about to write into it gets a private
  copy first.

This class only does the bookkeeping (plain Python ints); the tensors live in
``PagedKVCache``. Copies it decides on are returned to the caller to perform on the pool.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import minillm.hooks as hooks
from minillm.kvcache.addressing import RELEASED, blocks_for


class PagedSequence(Protocol):
    """What the block manager needs from a sequence."""

    request_id: Hashable
    num_computed_tokens: int  # tokens whose K/V are already in the pool

    @property
    def token_ids(self) -> list[int]: ...


@hooks.reference("block_hash")
def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The name of a full block: its tokens *and* everything before them (via the parent's hash).

    Chaining matters: the same 16 tokens after different prefixes have different K/V (attention
    saw different context), so they must not share a block. A real hash function (BLAKE2b over
    the parent's 8 bytes and the tokens as 64-bit integers) keeps names identical in every
    process and on every Python: the built-in ``hash()`` is not (``hash(None)`` changes per
    process before Python 3.12), and names must agree between workers that share a cache.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((0 if parent_hash is None else parent_hash + 1).to_bytes(8, "little"))
    h.update(array.array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids``, as the prefix cache names them
    (a data-parallel router and a KV hand-over name blocks the same way)."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hooks.block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@hooks.reference("blocks_behind_window")
def blocks_behind_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """How many leading blocks of a sequence no future query can see under a sliding window.

    The next query sits at position ``num_computed_tokens`` and sees keys from
    ``num_computed_tokens - window + 1`` on; a block is behind the window only when all of its
    positions come before that (a partly visible block stays)."""
    return max(0, num_computed_tokens - window + 1) // block_size


@hooks.reference("blocks_to_roll_back")
def blocks_to_roll_back(table: list[int], num_tokens: int, block_size: int) -> tuple[list[int], list[int]]:
    """Split a block table for a rollback to its first ``num_tokens`` tokens (speculative tokens
    the target rejected): ``(kept, freed)``.

    ``kept`` is the first ``blocks_for(num_tokens)`` entries — the last of them possibly only
    partly filled, and kept all the same. ``freed`` lists the blocks after them, **tail first**
    (the order ``free`` gives blocks back in), without entries already released behind a
    sliding window (``RELEASED``: no block to give back)."""
    keep = blocks_for(num_tokens, block_size)
    return table[:keep], [b for b in reversed(table[keep:]) if b != RELEASED]


@dataclass
class PoolStats:
    """The KV memory of running requests, for step records: counters, not walks over tables.
    All None where there is no paged pool (the naive and contiguous rungs)."""

    blocks_used: int | None = None
    blocks_cached: int | None = None
    blocks_free: int | None = None
    tokens_stored: int | None = None  # tokens in the cache of running requests (a shared prefix counted per request)
    reserved_slots: int | None = None  # slots in referenced blocks (a shared block counted once)
    wasted_slots: int | None = None  # reserved but unused


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the tokens of a hashed block, to verify a hash hit


@hooks.reference("block_pool")
class BlockPool:
    """The allocator under the block manager: who holds each block, and which full blocks the
    prefix cache can still hand out again.

    Four structures, which the manager's statistics and invariant checks read as they are:
    ``blocks`` (each block's ``ref_count`` and, once registered, its ``hash``, ``parent_hash`` and
    ``token_ids``), ``free_ids`` (never used, or evicted; handed out first in first out),
    ``cached`` (prefix hash → block id, for every named block, referenced or not) and
    ``evictable`` (named blocks nobody references, least recently released first). A block is
    in exactly one place: referenced, on the free list, or evictable. Chapter 03's exercise
    writes this class; the engine builds its pool through ``hooks.block_pool``.
    """

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def allocate(self) -> int:
        """A block with ``ref_count`` 1: the next free one, else the least recently used cached
        block, evicted (its name forgotten). ``RuntimeError`` when there is neither."""
        if self.free_ids:
            block_id = self.free_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.parent_hash, block.token_ids = None, None, ()
        else:
            raise RuntimeError("the KV pool has no free block")
        self.blocks[block_id].ref_count = 1
        return block_id

    def ref(self, block_id: int) -> None:
        """One more owner of a held or cached block (a prefix hit, a fork): a cached block
        nobody held is no longer evictable."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """One owner fewer. Unreferenced, a named block waits in ``evictable`` (newest last) with
        its K/V kept for a later hit; any other goes back on the free list. Releasing an
        unreferenced block is a double free: ``RuntimeError``."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed while not referenced (double free)")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)

    def register(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Name a full block by its prefix hash, so a later prompt can find it. A block that
        has a name keeps it, and a hash that names a block already keeps that block."""
        block = self.blocks[block_id]
        if block.hash is None and block_hash not in self.cached:
            block.hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
            self.cached[block_hash] = block_id

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """The block named ``block_hash`` if it holds exactly this prefix (the same parent and
        tokens: a hash collision is not a hit), else None."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block_id

    def forget(self, block_id: int) -> None:
        """Drop a block's name (a rollback left it part-filled, or the cache is reset): an
        unreferenced cached block becomes a plain free one."""
        block = self.blocks[block_id]
        if block.hash is None:
            return
        del self.cached[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()
        if block.ref_count == 0:
            del self.evictable[block_id]
            self.free_ids.append(block_id)


@hooks.reference("grow_table")
def grow_table(table: list[int], num_computed: int, num_new: int, block_size: int, ref_count, take, release) -> list:
    """Grow ``table`` in place to hold positions ``0 .. num_computed + num_new - 1``; the
    ``(shared, private)`` copies to do first. Only the block the first new token goes to can be
    shared (a cached prefix's last block, or a fork's): the blocks after it are new."""
    copies = []
    first = num_computed // block_size
    if first < len(table) and ref_count(table[first]) > 1:
        shared, private = table[first], take()
        release(shared)
        table[first] = private
        copies.append((shared, private))
    while len(table) < blocks_for(num_computed + num_new, block_size):
        table.append(take())
    return copies


class BlockManager:
    """Fixed-size blocks, a free list, reference counts, block tables and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = hooks.block_pool(num_blocks)  # the allocator (chapter 03's exercise plugs in here)
        # what grow_table is handed on every allocation, bound once (allocate_slots runs per sequence per step)
        self._grow_ops = (self.ref_count, self._take, self._release)
        self.tables: dict[Hashable, list[int]] = {}  # request id -> block table
        self.num_tokens: dict[Hashable, int] = {}  # request id -> slots reserved in its table
        self.chains: dict[Hashable, list[int]] = {}  # request id -> hashes of its full blocks so far
        # Prefix-cache statistics, over every lookup: prompt tokens asked for and found.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Counters kept as blocks change, so statistics never walk every table:
        self.fill = [0] * num_blocks  # valid slots of each block (a hashed block is full)
        self.num_filled_slots = 0  # sum of `fill` over referenced blocks
        self.num_reserved_tokens = 0  # sum of num_tokens: slots reserved per request

    # ----------------------------------------------------------------------------------------
    # Counters
    # ----------------------------------------------------------------------------------------

    # The pool's structures, read where statistics and invariants need them (``BlockPool``).
    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def free_ids(self) -> deque[int]:
        """Never used, or evicted."""
        return self.pool.free_ids

    @property
    def cached(self) -> dict[int, int]:
        """Block hash -> block id, for every hashed block."""
        return self.pool.cached

    @property
    def evictable(self) -> OrderedDict[int, None]:
        """Hashed, unreferenced blocks, least recently used first."""
        return self.pool.evictable

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never used, or cached and unreferenced (evictable)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks kept only for the prefix cache: hashed, unreferenced, reusable until evicted."""
        return len(self.evictable)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def wasted_slots(self) -> int:
        """Reserved but unused token slots in referenced blocks (a shared block counts once)."""
        return self.num_used_blocks * self.block_size - self.num_filled_slots

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id`` (2 or more: it is shared, copied before a write)."""
        return self.blocks[block_id].ref_count

    def pool_stats(self) -> PoolStats:
        used = self.num_used_blocks
        return PoolStats(
            used,
            self.num_cached_blocks,
            len(self.free_ids),
            self.num_reserved_tokens,
            used * self.block_size,
            self.wasted_slots(),
        )

    # ----------------------------------------------------------------------------------------
    # Allocation
    # ----------------------------------------------------------------------------------------

    # Every block is taken, shared and released through the pool (a learner's ``BlockPool`` in
    # chapter 03); the counters are kept here, around it, so a learner's pool is measured by the
    # same statistics.

    def _take(self) -> int:
        block_id = self.pool.allocate()
        self.fill[block_id] = 0
        return block_id

    def _attach(self, block_id: int) -> None:
        if self.blocks[block_id].ref_count == 0:  # back in use: its slots count again
            self.num_filled_slots += self.fill[block_id]
        self.pool.ref(block_id)

    def _release(self, block_id: int) -> None:
        self.pool.release(block_id)
        if self.blocks[block_id].ref_count == 0:
            self.num_filled_slots -= self.fill[block_id]
            if self.blocks[block_id].hash is None:
                self.fill[block_id] = 0

    def _set_fill(self, block_id: int, filled: int) -> None:
        self.num_filled_slots += filled - self.fill[block_id]
        self.fill[block_id] = filled

    def match_prefix(self, seq: PagedSequence) -> int:
        """Attach the cached blocks of ``seq``'s longest cached prefix; return the tokens they hold.

        Called once when a sequence is scheduled for the first time (or again after preemption).
        At least the last token is always left to compute: its forward pass produces the logits
        for the next token. If the whole sequence is cached, the last block is attached too and
        that one token is recomputed into it (copy-on-write if it is shared).
        """
        if seq.request_id in self.tables:
            raise RuntimeError(f"request {seq.request_id!r} already has blocks")
        tokens = seq.token_ids
        table: list[int] = []
        parent = None
        if self.enable_prefix_caching:
            for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
                chunk = tokens[start : start + self.block_size]
                h = hooks.block_hash(parent, chunk)
                block_id = self.pool.lookup(h, parent, chunk)  # None on a miss, or a collision
                if block_id is None:
                    break
                self._attach(block_id)
                table.append(block_id)
                parent = h
        cached_tokens = min(len(table) * self.block_size, len(tokens) - 1)
        self.tables[seq.request_id] = table
        self.chains[seq.request_id] = [self.blocks[b].hash for b in table]
        self.num_tokens[seq.request_id] = cached_tokens
        self.num_reserved_tokens += cached_tokens
        seq.num_computed_tokens = cached_tokens
        self.prefix_queries += len(tokens)
        self.prefix_hits += cached_tokens
        return cached_tokens

    def cancel_prefix(self, seq: PagedSequence) -> None:
        """Undo a ``match_prefix`` whose sequence could not be scheduled after all."""
        self.prefix_queries -= len(seq.token_ids)
        self.prefix_hits -= seq.num_computed_tokens
        self.free(seq)
        seq.num_computed_tokens = 0

    def can_allocate(self, seq: PagedSequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def blocks_needed(self, seq: PagedSequence, num_new_tokens: int) -> int:
        """New blocks needed to write ``num_new_tokens`` after ``seq.num_computed_tokens``
        (counting a copy-on-write of a shared block that would be written)."""
        table = self.tables.get(seq.request_id, [])
        end = seq.num_computed_tokens + num_new_tokens
        needed = max(0, self.blocks_for(end) - len(table))
        first = seq.num_computed_tokens // self.block_size
        if first < len(table) and self.blocks[table[first]].ref_count > 1:
            needed += 1
        return needed

    def allocate_slots(self, seq: PagedSequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make room to write ``num_new_tokens`` tokens after the ``num_computed_tokens`` already
        in the pool. Returns the ``(src, dst)`` block copies to perform first (copy-on-write),
        or ``None`` — changing nothing — if the pool has too few free blocks."""
        # Runs for every scheduled sequence on every step, so blocks_needed is written out here
        # (the same arithmetic) and most calls — a decode token that fits its last, private
        # block — end without a block to take or copy.
        table = self.tables.get(seq.request_id)
        if table is None:
            raise RuntimeError(f"request {seq.request_id!r} has no block table; call match_prefix first")
        computed, bs = seq.num_computed_tokens, self.block_size
        end = computed + num_new_tokens
        first = computed // bs
        needed = max(0, -(-end // bs) - len(table))
        if first < len(table) and self.pool.blocks[table[first]].ref_count > 1:
            needed += 1
        if needed > self.num_free_blocks:
            return None
        # chapter 03's exercise plugs in here: copy-on-write of a shared block, then growth
        copies = hooks.grow_table(table, computed, num_new_tokens, bs, *self._grow_ops) if needed else []
        fill = self.fill
        for j in range(first, -(-end // bs)):
            filled = min(bs, end - j * bs)
            if table[j] != RELEASED and filled > fill[table[j]]:
                self._set_fill(table[j], filled)
        grown = end - self.num_tokens[seq.request_id]
        if grown > 0:
            self.num_tokens[seq.request_id] = end
            self.num_reserved_tokens += grown
        return copies

    def allocate_decode_slots(self, seqs: list[PagedSequence]) -> list[tuple[int, int]] | None:
        """``allocate_slots(seq, 1)`` for every one of ``seqs`` (decoding sequences: one new token
        each), or ``None``, changing nothing, when the pool cannot give all of them their slot.

        The steady state of a decode step in one pass (the scheduler's ``reserve_decodes``): most
        sequences write into the last, private block they hold already, which changes only that
        block's fill and the slots reserved; the few that cross into a new block (one step in
        ``block_size``) or must copy a shared one go through ``allocate_slots`` — and chapter
        03's ``grow_table`` — as before, in the same order, so they take the same blocks."""
        tables, blocks, bs = self.tables, self.pool.blocks, self.block_size
        growing = []
        for seq in seqs:
            table = tables[seq.request_id]
            j = seq.num_computed_tokens // bs
            if j >= len(table) or blocks[table[j]].ref_count > 1:
                growing.append(seq)  # a new block, or a copy of a shared one
        if len(growing) > self.num_free_blocks:
            return None
        copies = []
        for seq in growing:
            copies += self.allocate_slots(seq, 1)  # fits: counted above
        # Everyone's fill and reservation (for the growing ones allocate_slots did it already:
        # then nothing changes here).
        fill, num_tokens = self.fill, self.num_tokens
        filled_slots = reserved = 0
        for seq in seqs:
            request_id, computed = seq.request_id, seq.num_computed_tokens
            block = tables[request_id][computed // bs]
            filled = computed % bs + 1
            if filled > fill[block]:
                filled_slots += filled - fill[block]
                fill[block] = filled
            if computed + 1 > num_tokens[request_id]:
                reserved += computed + 1 - num_tokens[request_id]
                num_tokens[request_id] = computed + 1
        self.num_filled_slots += filled_slots
        self.num_reserved_tokens += reserved
        return copies

    def commit(self, seq: PagedSequence) -> None:
        """Register ``seq``'s blocks that are now full of computed tokens in the prefix cache.

        Called after every step, so it only looks at blocks that filled up since the last call
        (``chains`` keeps each request's block hashes so far): about one block every
        ``block_size`` steps of decoding."""
        if not self.enable_prefix_caching:
            return
        chain = self.chains[seq.request_id]
        full = seq.num_computed_tokens // self.block_size
        if len(chain) >= full:
            return
        table = self.tables[seq.request_id]
        tokens = seq.token_ids
        for j in range(len(chain), full):
            chunk = tokens[j * self.block_size : (j + 1) * self.block_size]
            parent = chain[-1] if chain else None
            h = hooks.block_hash(parent, chunk)
            chain.append(h)
            if table[j] == RELEASED:  # gone behind a sliding window: only the hash chain goes on
                continue
            self.pool.register(table[j], h, parent, chunk)  # unless this content is cached already

    def fork(self, parent: PagedSequence, child: PagedSequence) -> None:
        """``child`` shares every block of ``parent`` (e.g. several samples of one prompt)."""
        if child.request_id in self.tables:
            raise RuntimeError(f"request {child.request_id!r} already has blocks")
        table = list(self.tables[parent.request_id])
        for block_id in table:
            if block_id != RELEASED:
                self._attach(block_id)
        self.tables[child.request_id] = table
        self.num_tokens[child.request_id] = self.num_tokens[parent.request_id]
        self.num_reserved_tokens += self.num_tokens[parent.request_id]
        self.chains[child.request_id] = list(self.chains[parent.request_id])
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: PagedSequence) -> None:
        """Drop ``seq``'s references. Blocks are released tail first, so when the pool runs
        short the end of a prefix is evicted before its beginning (which more requests share)."""
        table = self.tables.pop(seq.request_id, None)
        if table is None:
            raise RuntimeError(f"request {seq.request_id!r} has no blocks to free")
        self.num_reserved_tokens -= self.num_tokens.pop(seq.request_id)
        del self.chains[seq.request_id]
        for block_id in reversed(table):
            if block_id != RELEASED:
                self._release(block_id)

    def truncate(self, seq: PagedSequence, num_tokens: int, window: int | None = None) -> int:
        """Roll ``seq`` back to its first ``num_tokens`` tokens (rejected speculative tokens):
        blocks past them go back to the pool (tail first), a block that is no longer full
        forgets its prefix hash (its slots will be overwritten), and ``num_computed_tokens``
        drops to at most ``num_tokens``. A shared block keeps its hash for the others; the next
        write into it is copied first. Returns how many blocks were freed.

        With a sliding ``window``, blocks behind it may already be gone: rolling back so far
        that the next query would need one of them is refused (``ValueError``) — release
        blocks behind the window only for tokens that can no longer be rolled back."""
        if seq.request_id not in self.tables:
            raise RuntimeError(f"request {seq.request_id!r} has no blocks to truncate")
        reserved = self.num_tokens[seq.request_id]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= reserved:
            raise ValueError(f"truncate: num_tokens={num_tokens!r} must be an int in [0, {reserved}]")
        table = self.tables[seq.request_id]
        kept, freed = hooks.blocks_to_roll_back(list(table), num_tokens, self.block_size)  # the chapter-08 exercise
        keep = len(kept)
        first_needed = 0 if window is None else max(0, num_tokens - window + 1) // self.block_size
        if any(b == RELEASED for b in kept[first_needed:]):
            raise ValueError(
                f"truncate: request {seq.request_id!r} cannot roll back to {num_tokens} tokens: blocks its next "
                "query would attend to were already released behind the sliding window"
            )
        table[:] = kept
        for block_id in freed:
            self._release(block_id)
        partial = num_tokens - (keep - 1) * self.block_size
        if keep and partial < self.block_size and table[-1] != RELEASED:
            block = self.blocks[table[-1]]
            if block.ref_count == 1:  # ours alone: no longer full, so no longer a cached prefix
                self.pool.forget(block.block_id)
                self._set_fill(block.block_id, partial)
        del self.chains[seq.request_id][num_tokens // self.block_size :]
        self.num_tokens[seq.request_id] = num_tokens
        self.num_reserved_tokens -= reserved - num_tokens
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        return len(freed)

    def release_behind_window(self, seq: PagedSequence, window: int) -> int:
        """Sliding-window attention: give back the blocks no future query of ``seq`` can see.

        The next query sits at position ``num_computed_tokens`` and sees keys from
        ``num_computed_tokens - window + 1`` on; blocks entirely before that are released (their
        table entries become ``RELEASED``). Returns how many were released.

        Released entries always form a prefix of the table (every earlier call released all the
        blocks behind its window), so the walk goes back from the window's edge and stops at the
        first entry already released: per step, work for the newly released blocks only, not
        for every block of a long sequence."""
        table = self.tables[seq.request_id]
        released = 0
        j = min(len(table), hooks.blocks_behind_window(seq.num_computed_tokens, window, self.block_size)) - 1
        while j >= 0 and table[j] != RELEASED:
            self._release(table[j])
            table[j] = RELEASED
            released += 1
            j -= 1
        return released

    def reserve_imported(self, token_ids: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Room for the K/V of ``token_ids``'s full blocks, computed by another engine
        (disaggregated prefill): each block is named by its hash as ``commit`` would name it, so
        the request's ``match_prefix`` finds it like any cached prefix. Returns (every block
        held — release with ``release_imported`` once their K/V is written — and the
        ``(block index, block id)`` pairs whose K/V must be written; blocks already cached here
        need none). Stops early, keeping what it has, when no block is free."""
        held: list[int] = []
        to_fill: list[tuple[int, int]] = []
        if not self.enable_prefix_caching:
            return held, to_fill
        parent = None
        for j, h in enumerate(prompt_block_hashes(token_ids, self.block_size)):
            chunk = tuple(token_ids[j * self.block_size : (j + 1) * self.block_size])
            block_id = self.pool.lookup(h, parent, chunk)
            if block_id is not None:
                self._attach(block_id)  # held, so importing the next block cannot evict it
            elif h not in self.cached and self.num_free_blocks > 0:
                block_id = self._take()
                self._set_fill(block_id, self.block_size)
                self.pool.register(block_id, h, parent, chunk)
                to_fill.append((j, block_id))
            else:
                break
            held.append(block_id)
            parent = h
        return held, to_fill

    def release_imported(self, held: list[int]) -> None:
        """The imported blocks' K/V is written: unreferenced and cached, waiting for their request."""
        for block_id in held:
            self._release(block_id)

    def block_table_of(self, seq: PagedSequence) -> list[int]:
        return self.tables[seq.request_id]

    def reset_prefix_cache(self) -> None:
        """Forget every cached, unreferenced block and the hit statistics (blocks in use keep theirs)."""
        for block_id in list(self.evictable):
            self.pool.forget(block_id)  # unreferenced: back on the free list
            self.fill[block_id] = 0
        self.prefix_queries = self.prefix_hits = 0

    # ----------------------------------------------------------------------------------------
    # Invariants (used by tests and the course checks)
    # ----------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant."""
        counts = [0] * self.num_blocks
        for rid, table in self.tables.items():
            released = sum(b == RELEASED for b in table)
            assert all(b == RELEASED for b in table[:released]), (
                f"request {rid!r}: released entries are not a prefix of its table {table}"
            )
            for b in table:
                if b != RELEASED:
                    counts[b] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id} has ref_count {block.ref_count} but {counts[block.block_id]} "
                "block tables hold it"
            )
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice (double free)"
        for b in free:
            assert counts[b] == 0, f"block {b} is on the free list while still referenced"
            assert self.blocks[b].hash is None, f"free block {b} still has a prefix hash"
        for b in self.evictable:
            assert counts[b] == 0, f"block {b} is evictable while still referenced"
            assert b not in free, f"block {b} is both free and cached"
        unreferenced = {b.block_id for b in self.blocks if b.ref_count == 0}
        assert unreferenced == free | set(self.evictable), (
            f"blocks leaked (neither referenced, free nor cached): {sorted(unreferenced - free - set(self.evictable))}"
        )
        for h, b in self.cached.items():
            assert self.blocks[b].hash == h, f"prefix cache maps a hash to block {b}, which holds another hash"
        # The counters agree with a walk over every table (a hashed block is full).
        filled: dict[int, int] = {}
        for rid, table in self.tables.items():
            n = self.num_tokens[rid]
            for i, b in enumerate(table):
                if b != RELEASED:
                    full = self.block_size if self.blocks[b].hash is not None else n - i * self.block_size
                    filled[b] = max(filled.get(b, 0), min(self.block_size, full))
        assert self.num_filled_slots == sum(filled.values()), (
            f"filled-slot counter {self.num_filled_slots} != {sum(filled.values())} counted over the tables"
        )
        assert self.num_reserved_tokens == sum(self.num_tokens.values()), "reserved-token counter out of step"
