"""Chapter 03, the paged KV cache: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict, deque

import torch

from catalogue.answers import Answers
from minillm.kvcache.block_manager import Block

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 03: the paged KV cache -----------------------------------------------------------------


def grow_table(table, num_computed, num_new, block_size, ref_count, take, release):
    copies = []
    first = num_computed // block_size
    if first < len(table) and ref_count(table[first]) > 1:
        private = take()
        copies.append((table[first], private))
        release(table[first])
        table[first] = private
    while len(table) * block_size < num_computed + num_new:
        table.append(take())
    return copies


def grow_table_counted(table, num_computed, num_new, block_size, ref_count, take, release):
    """Right, written differently: count the blocks needed first; copy on write by index."""
    need = math.ceil((num_computed + num_new) / block_size)
    out = []
    j = num_computed // block_size
    if j < len(table) and ref_count(table[j]) >= 2:
        old, new = table[j], take()
        release(old)
        table[j] = new
        out.append((old, new))
    table.extend(take() for _ in range(need - len(table)))
    return out


BT = "check_block_table"  # chapter 03's block table: grow_table, then slot_mapping


def slots_right(fn) -> None:
    right(BT, grow_table, fn)


def slots_wrong(message: str, fn) -> None:
    wrong(BT, message, grow_table, fn)


def slot_mapping(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def slot_mapping_divmod(block_table, start, num_tokens, block_size):
    slots = []
    for position in range(start, start + num_tokens):
        block, offset = divmod(position, block_size)
        slots.append(block_table[block] * block_size + offset)
    return slots


right(BT, grow_table, slot_mapping)
right(BT, grow_table_counted, slot_mapping_divmod)
slots_wrong("positions themselves", lambda t, s, n, b: list(range(s, s + n)))
slots_wrong("offsets inside blocks", lambda t, s, n, b: [p % b for p in range(s, s + n)])
slots_wrong(
    "expected [31, 8, 9, 10]",
    lambda t, s, n, b: [t[p // b] + p % b for p in range(s, s + n)],
)
slots_wrong(
    "your code raised IndexError",
    lambda t, s, n, b: [t[p % b] * b + p // b for p in range(s, s + n)],
)
slots_wrong("expected [31, 8, 9, 10]", lambda t, s, n, b: slot_mapping(t, s + 1, n, b))
slots_wrong("expected [31, 8, 9, 10]", lambda t, s, n, b: torch.tensor(slot_mapping(t, s, n, b)))


def gather_kv(slots, block_tables, block_size):
    b, n = block_tables.shape
    blocks = slots.view(-1, block_size, *slots.shape[1:])
    return blocks[block_tables].reshape(b, n * block_size, *slots.shape[1:]).transpose(1, 2)


def gather_kv_rows(slots, block_tables, block_size):
    rows = []
    for table in block_tables.tolist():
        index = torch.tensor([blk * block_size + i for blk in table for i in range(block_size)])
        rows.append(slots.index_select(0, index).permute(1, 0, 2))
    return torch.stack(rows)


right("check_gather_kv", gather_kv)
right("check_gather_kv", gather_kv_rows)
wrong("check_gather_kv", "heads before positions", lambda s, t, b: gather_kv(s, t, b).transpose(1, 2))
wrong("check_gather_kv", "one slot per block table entry", lambda s, t, b: s[t])
wrong("check_gather_kv", "one slot per block table entry", lambda s, t, b: s[t * b])
wrong("check_gather_kv", "block-table order", lambda s, t, b: gather_kv(s, t.sort(dim=1).values, b))
wrong("check_gather_kv", "differs from the reference", lambda s, t, b: gather_kv(s, t[:1].expand_as(t), b))
wrong("check_gather_kv", "has shape (2, 12, 3, 2)", lambda s, t, b: gather_kv(s, t, b).transpose(1, 2).transpose(2, 3))




def block_hash(parent_hash, token_ids):
    h = hashlib.sha256()
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest()[:8], "little")


def block_hash_text(parent_hash, token_ids):
    text = f"{parent_hash}|{','.join(map(str, token_ids))}"
    return int(hashlib.blake2b(text.encode(), digest_size=8).hexdigest(), 16)


def _sha_tokens(token_ids):
    return int(hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()[:15], 16)


right("check_block_hash", block_hash)
right("check_block_hash", block_hash_text)
wrong("check_block_hash", "different prefixes", lambda parent, ids: _sha_tokens(ids))
wrong("check_block_hash", "swapped order", lambda parent, ids: (parent or 0) ^ _sha_tokens(ids))
wrong("check_block_hash", "built-in hash()", lambda parent, ids: hash((parent, tuple(ids))))
wrong("check_block_hash", "ignores the order", lambda parent, ids: (parent or 0) * 31 + sum(ids))
wrong(
    "check_block_hash",
    "should return an int",
    lambda parent, ids: hashlib.sha256(repr((parent, ids)).encode()).hexdigest(),
)
wrong(
    "check_block_hash",
    "different results for the same tokens",
    lambda parent, ids: int(hashlib.sha256(repr((parent, ids)).encode()).hexdigest()[:15], 16),
)
wrong(
    "check_block_hash",
    ".digest() returns bytes, and block_hash must return an int",
    lambda parent, ids: hashlib.blake2b(repr((parent, tuple(ids))).encode(), digest_size=8).digest(),
)


# ---- ch03: more wrong answers a learner writes


# ---- slot_mapping ---------------------------------------------------------------------------


def _slots_one_short(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens - 1)]


def _slots_from_zero(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]


def _slots_end_is_num_tokens(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, num_tokens)]


def _slots_whole_position(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p for p in range(start, start + num_tokens)]


def _slots_block_size_16(block_table, start, num_tokens, block_size):
    block = 16  # the engine's default block size
    return [block_table[p // block] * block + p % block for p in range(start, start + num_tokens)]


def _slots_count_up(block_table, start, num_tokens, block_size):
    first = block_table[start // block_size] * block_size + start % block_size
    return [first + i for i in range(num_tokens)]


def _slots_rounded_block(block_table, start, num_tokens, block_size):
    return [block_table[round(p / block_size)] * block_size + p % block_size for p in range(start, start + num_tokens)]


def _slots_table_in_place(block_table, start, num_tokens, block_size):
    for i, block in enumerate(block_table):  # the table's blocks turned into their first slots
        block_table[i] = block * block_size
    return [block_table[p // block_size] + p % block_size for p in range(start, start + num_tokens)]


def _slots_generator(block_table, start, num_tokens, block_size):
    return (block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens))


slots_wrong("those are the slots of positions 3-5", _slots_one_short)
slots_wrong("those are the slots of positions 0-3", _slots_from_zero)
slots_wrong("those are the slots of position 3 only", _slots_end_is_num_tokens)
slots_wrong("you added the position itself", _slots_whole_position)
slots_wrong("slots for block_size=16: use the block_size argument", _slots_block_size_16)
slots_wrong("position 4 starts a new block", _slots_count_up)
slots_wrong(
    "block_table[1] instead of block_table[0] (the block index is p // block_size, rounded down)",
    _slots_rounded_block,
)
slots_wrong("changed the block table it was given", _slots_table_in_place)
slots_wrong("returned a generator", _slots_generator)

# ---- gather_kv ------------------------------------------------------------------------------


def _gather_reshape_heads(slots, block_tables, block_size):
    b, n = block_tables.shape
    blocks = slots.view(-1, block_size, *slots.shape[1:])
    return blocks[block_tables].reshape(b, slots.shape[1], n * block_size, slots.shape[2])


def _gather_float32_buffer(slots, block_tables, block_size):
    b, n = block_tables.shape
    out = torch.zeros(b, slots.shape[1], n * block_size, slots.shape[2])
    for row in range(b):
        for j in range(n):
            first = int(block_tables[row, j]) * block_size
            out[row, :, j * block_size : (j + 1) * block_size] = slots[first : first + block_size].transpose(0, 1)
    return out


def _gather_first_slot_only(slots, block_tables, block_size):
    return slots[(block_tables * block_size).repeat_interleave(block_size, dim=1)].transpose(1, 2)


def _gather_block_plus_offset(slots, block_tables, block_size):
    index = (block_tables[:, :, None] + torch.arange(block_size)).flatten(1)
    return slots[index].transpose(1, 2)


def _gather_offset_major(slots, block_tables, block_size):
    b, n = block_tables.shape
    blocks = slots.view(-1, block_size, *slots.shape[1:])[block_tables]  # [B, n, block_size, KV, D]
    return blocks.permute(0, 3, 2, 1, 4).reshape(b, slots.shape[1], n * block_size, slots.shape[2])


def _gather_one_based_blocks(slots, block_tables, block_size):
    return gather_kv(slots, block_tables - 1, block_size)


def _gather_tables_in_place(slots, block_tables, block_size):
    block_tables *= block_size  # each block's first slot
    index = (block_tables[:, :, None] + torch.arange(block_size)).flatten(1)
    return slots[index].transpose(1, 2)


def _gather_all_but_last_block(slots, block_tables, block_size):
    return gather_kv(slots, block_tables[:, :-1], block_size)


wrong("check_gather_kv", "head 1's values: the heads got mixed with the positions", _gather_reshape_heads)
wrong("check_gather_kv", "gather_kv returned torch.float32 from bfloat16 slots", _gather_float32_buffer)
wrong("check_gather_kv", "the right block, the wrong offset", _gather_first_slot_only)
wrong("check_gather_kv", "the block id used as a slot", _gather_block_plus_offset)
wrong("check_gather_kv", "holds the right values in the wrong order", _gather_offset_major)
wrong(
    "check_gather_kv",
    "holds slot 24 (offset 0 of block 6), a block that row 0's table [7, 2, 9] does not list",
    _gather_one_based_blocks,
)
wrong("check_gather_kv", "changed the block_tables it was given", _gather_tables_in_place)
wrong("check_gather_kv", "8 positions per row, where the rows' tables list 3 blocks", _gather_all_but_last_block)

# ---- block_hash -----------------------------------------------------------------------------


def _digest_int(h):
    return int.from_bytes(h.digest()[:8], "little")


def _hash_skips_last_token(parent_hash, token_ids):
    h = hashlib.sha256((parent_hash or 0).to_bytes(8, "little"))
    for i in range(len(token_ids) - 1):
        h.update(struct.pack("<q", token_ids[i]))
    return _digest_int(h)


def _hash_one_byte_tokens(parent_hash, token_ids):
    return _digest_int(hashlib.sha256((parent_hash or 0).to_bytes(8, "little") + bytes(token_ids)))


def _hash_whole_digest(parent_hash, token_ids):
    h = hashlib.sha256((parent_hash or 0).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")  # all 32 bytes: a 256-bit int


def _hash_joined_digits(parent_hash, token_ids):
    text = f"{parent_hash}:" + "".join(str(t) for t in token_ids)
    return _digest_int(hashlib.sha256(text.encode()))


def _hash_appends_parent(parent_hash, token_ids):
    token_ids.append(parent_hash or 0)  # hash the parent together with the tokens
    return _digest_int(hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)))


def _stable_key(parent_hash, token_ids):
    return hash((parent_hash, tuple(token_ids)))


def _hash_through_builtin_hash(parent_hash, token_ids):
    key = _stable_key(parent_hash, token_ids)
    return _digest_int(hashlib.sha256(key.to_bytes(8, "little", signed=True)))


def _hash_parent_packed_as_is(parent_hash, token_ids):
    return _digest_int(hashlib.sha256(struct.pack(f"<Q{len(token_ids)}q", parent_hash, *token_ids)))


def _hash_four_bytes(parent_hash, token_ids):
    h = hashlib.sha256((parent_hash or 0).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest()[:4], "little")  # "4 bytes is plenty": 2^32 names


def _hash_mod_prime(parent_hash, token_ids):
    h = hashlib.blake2b(str((parent_hash, tuple(token_ids))).encode())
    return int.from_bytes(h.digest(), "little") % 1_000_003  # a small table's worth of names


wrong("check_block_hash", "your hashes fit in 32 bits (about 4 bytes of the digest)", _hash_four_bytes)
wrong("check_block_hash", "your hashes fit in 20 bits", _hash_mod_prime)
wrong("check_block_hash", "it ignores token 3 of the block", _hash_skips_last_token)
wrong("check_block_hash", "token ids go up to the vocabulary size", _hash_one_byte_tokens)
wrong("check_block_hash", "parent_hash is a hash your function returned (a 254-bit int)", _hash_whole_digest)
wrong("check_block_hash", "blocks [1, 23, 4, 5] and [12, 3, 4, 5] got the same hash", _hash_joined_digits)
wrong("check_block_hash", "block_hash changed the token list it was given", _hash_appends_parent)
wrong("check_block_hash", "built-in hash()", _hash_through_builtin_hash)
wrong("check_block_hash", "a sequence's first block has parent_hash None", _hash_parent_packed_as_is)


# ---- Chapter 03's block allocator (``check_block_pool``): right answers written independently, and
# the wrong ones a learner writes, one slip each (``pool_with(...)``).


BP = "check_block_pool"


def pool_with(**slip):
    """The reference pool with one of a learner's slips switched on."""

    class BlockPool:
        def __init__(self, num_blocks):
            self.blocks = [Block(i) for i in range(num_blocks)]
            self.free_ids = deque(range(num_blocks))
            self.cached = {}
            self.evictable = OrderedDict()

        def _unname(self, block):
            if not slip.get("evict_keeps_cached"):
                del self.cached[block.hash]
            if not slip.get("evict_keeps_hash"):
                block.hash, block.parent_hash, block.token_ids = None, None, ()

        def allocate(self):
            if self.evictable and slip.get("evict_first"):
                block_id, _ = self.evictable.popitem(last=False)
                self._unname(self.blocks[block_id])
            elif self.free_ids:
                block_id = self.free_ids[0] if slip.get("keeps_free") else self.free_ids.popleft()
            elif self.evictable:
                if slip.get("lifo"):
                    block_id, _ = self.evictable.popitem()
                elif slip.get("smallest"):
                    block_id = min(self.evictable)
                    del self.evictable[block_id]
                else:
                    block_id, _ = self.evictable.popitem(last=False)
                self._unname(self.blocks[block_id])
            elif slip.get("returns_none"):
                return None
            else:
                raise RuntimeError("no free block")
            if not slip.get("no_refcount"):
                self.blocks[block_id].ref_count = 1
            return block_id

        def ref(self, block_id):
            block = self.blocks[block_id]
            if block.ref_count == 0 and not slip.get("ref_keeps_evictable"):
                del self.evictable[block_id]
            block.ref_count += 1

        def release(self, block_id):
            block = self.blocks[block_id]
            if block.ref_count <= 0 and not slip.get("no_double_free"):
                raise RuntimeError(f"block {block_id}: double free")
            block.ref_count = 0 if slip.get("release_at_once") else block.ref_count - 1
            if block.ref_count == 0:
                if block.hash is not None and not slip.get("forgets_cache"):
                    if slip.get("cached_to_front"):
                        self.evictable[block_id] = None
                        self.evictable.move_to_end(block_id, last=False)
                    else:
                        self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)

        def register(self, block_id, block_hash, parent_hash, token_ids):
            block = self.blocks[block_id]
            if slip.get("register_overwrites") or (block.hash is None and block_hash not in self.cached):
                if block.hash is not None:
                    del self.cached[block.hash]
                block.hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
                self.cached[block_hash] = block_id

        def lookup(self, block_hash, parent_hash, token_ids):
            block_id = self.cached.get(block_hash)
            if block_id is None:
                return None
            block = self.blocks[block_id]
            if block.parent_hash != parent_hash and not slip.get("ignores_parent"):
                return None
            if block.token_ids != tuple(token_ids) and not slip.get("ignores_tokens"):
                return None
            return block_id

        def forget(self, block_id):
            block = self.blocks[block_id]
            if block.hash is None:
                return
            del self.cached[block.hash]
            block.hash, block.parent_hash, block.token_ids = None, None, ()
            if block.ref_count == 0 and not slip.get("forget_strands"):
                del self.evictable[block_id]
                self.free_ids.append(block_id)

    return BlockPool


right(BP, pool_with())


class BlockPoolLists:
    """Plain lists and a dict (insertion-ordered) for the LRU; names kept on the blocks."""

    def __init__(self, num_blocks):
        self.blocks = [Block(b) for b in range(num_blocks)]
        self.free_ids = list(range(num_blocks))
        self.cached = {}
        self.evictable = {}  # dicts keep insertion order: the first key is the oldest

    def _drop_name(self, b):
        blk = self.blocks[b]
        self.cached.pop(blk.hash)
        blk.hash, blk.parent_hash, blk.token_ids = None, None, ()

    def allocate(self):
        if len(self.free_ids) > 0:
            b = self.free_ids.pop(0)
        elif len(self.evictable) > 0:
            b = next(iter(self.evictable))
            del self.evictable[b]
            self._drop_name(b)
        else:
            raise RuntimeError("out of KV blocks")
        self.blocks[b].ref_count = 1
        return b

    def ref(self, b):
        self.evictable.pop(b, None)
        self.blocks[b].ref_count += 1

    def release(self, b):
        blk = self.blocks[b]
        if blk.ref_count == 0:
            raise RuntimeError(f"double free of block {b}")
        blk.ref_count -= 1
        if blk.ref_count > 0:
            return
        if blk.hash is None:
            self.free_ids.append(b)
        else:
            self.evictable[b] = True

    def register(self, b, h, parent, tokens):
        if self.blocks[b].hash is not None or h in self.cached:
            return
        self.blocks[b].hash, self.blocks[b].parent_hash, self.blocks[b].token_ids = h, parent, tuple(tokens)
        self.cached[h] = b

    def lookup(self, h, parent, tokens):
        b = self.cached.get(h)
        ok = b is not None and self.blocks[b].parent_hash == parent and self.blocks[b].token_ids == tuple(tokens)
        return b if ok else None

    def forget(self, b):
        if self.blocks[b].hash is None:
            return
        self._drop_name(b)
        if b in self.evictable:
            del self.evictable[b]
            self.free_ids.append(b)


right(BP, BlockPoolLists)

wrong(BP, "the least recently used is", pool_with(lifo=True))
wrong(BP, "the least recently used is", pool_with(smallest=True))
wrong(BP, "the least recently used is", pool_with(cached_to_front=True))
wrong(BP, "is referenced (1) and evictable", pool_with(ref_keeps_evictable=True))
wrong(BP, "ref_count 1", pool_with(no_refcount=True))
wrong(BP, "is referenced (1) and on the free list", pool_with(keeps_free=True))
wrong(BP, "evict only when it is empty", pool_with(evict_first=True))
wrong(BP, "delete its hash from cached too", pool_with(evict_keeps_cached=True))
wrong(BP, "clear block.hash, parent_hash and token_ids", pool_with(evict_keeps_hash=True))
wrong(BP, "a double free must raise RuntimeError", pool_with(no_double_free=True))
wrong(BP, "went back on the free list after one release", pool_with(release_at_once=True))
wrong(BP, "is on the free list but still named 1234", pool_with(forgets_cache=True))
wrong(BP, "a hash collision is not a hit", pool_with(ignores_tokens=True))
wrong(BP, "compare the stored parent_hash too", pool_with(ignores_parent=True))
wrong(BP, "a named block keeps its name", pool_with(register_overwrites=True))
wrong(BP, "is evictable but has no name", pool_with(forget_strands=True))
wrong(BP, "running out must raise RuntimeError", pool_with(returns_none=True))


# ---- Chapter 03's block table (``check_block_table``): the wrong ``grow_table`` a learner writes, one slip
# each (``grow_with``), beside a right slot mapping.


def grow_with(**slip):
    """The copy-then-grow answer, with one learner's slip switched on."""

    def grow_table(table, num_computed, num_new, block_size, ref_count, take, release):
        if slip.get("new_list"):
            table = list(table)
        copies = []
        first = num_computed // block_size
        if slip.get("last_block"):
            first = max(len(table) - 1, 0)
        shared = (lambda b: ref_count(b) >= 1) if slip.get("copies_unshared") else (lambda b: ref_count(b) > 1)
        blocks = range(len(table)) if slip.get("every_shared") else [first]
        for j in blocks:
            if slip.get("no_copy") or not (j < len(table) or slip.get("le_bound")) or not shared(table[j]):
                continue
            private = take()
            copies.append((private, table[j]) if slip.get("reversed") else (table[j], private))
            if not slip.get("no_release"):
                release(table[j])
            if slip.get("append_copy"):
                table.append(private)
            else:
                table[j] = private
        end = num_new if slip.get("only_new") else num_computed + num_new
        if slip.get("floor"):
            while len(table) < end // block_size:
                table.append(take())
        elif slip.get("one_more"):
            while len(table) <= end // block_size:
                table.append(take())
        elif slip.get("forgets_append"):
            while len(table) * block_size < end:
                take()
        else:
            while len(table) * block_size < end:
                table.append(take())
        if slip.get("spare"):
            take()  # one for later, never used
        if slip.get("returns_table"):
            return table
        return copies

    return grow_table


wrong(BT, "writing into it would change the other sequence's K/V", grow_with(no_copy=True), slot_mapping)
wrong(BT, "still counts a reference to shared block", grow_with(no_release=True), slot_mapping)
wrong(BT, "a copy goes (src, dst) = (shared block, private copy)", grow_with(reversed=True), slot_mapping)
wrong(BT, "need ceil(10 / 4) = 3 blocks", grow_with(floor=True), slot_mapping)
wrong(BT, "the table has 3 blocks afterwards, expected 2", grow_with(one_more=True), slot_mapping)
wrong(BT, "grow the table in place", grow_with(new_list=True, returns_table=True), slot_mapping)
wrong(BT, "return the list of (src, dst) block copies", grow_with(returns_table=True), slot_mapping)
wrong(BT, "no new token is written into block 7", grow_with(every_shared=True), slot_mapping)
wrong(BT, "no new token is written into block 8", grow_with(last_block=True), slot_mapping)
wrong(BT, "is not shared (ref_count 1)", grow_with(copies_unshared=True), slot_mapping)
wrong(BT, "every block taken must end up in the table", grow_with(spare=True), slot_mapping)
wrong(BT, "the table has 3 blocks afterwards, expected 2", grow_with(append_copy=True), slot_mapping)
wrong(BT, "your code raised IndexError", grow_with(le_bound=True), slot_mapping)
wrong(BT, "the table has 2 blocks afterwards, expected 3", grow_with(only_new=True), slot_mapping)
wrong(BT, "does every turn of its loop add a block to the table?", grow_with(forgets_append=True), slot_mapping)
