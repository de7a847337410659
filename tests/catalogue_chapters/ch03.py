"""Chapter 03: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import hashlib
import struct

import torch
from check_catalogue import gather_kv, slots_wrong, wrong

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
