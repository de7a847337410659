"""Chapter 03 (the paged KV cache): the gather over a block table, and the prefix hash."""

from __future__ import annotations

import builtins
import contextlib
import math
import sys

import torch

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.checks.engines import (
    PROMPTS,
    SYSTEM,
    assert_pool_clean,
    compare_request_tokens,
    contiguous_reference,
    paged_engine,
    run_all,
    run_scattered,
)
from minillm.course.compare import compare_tensors
from minillm.course.results import CheckFailed, check, learner_cause


def _gather_mistake(got: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, block_size: int) -> str:
    """Where the first wrong entry of a gather came from: which slot (found by its value in the
    pool), of which block and head, against the slot the block table names."""
    expected = slots.view(-1, block_size, *slots.shape[1:])[tables].flatten(1, 2).transpose(1, 2)
    row, head, pos = (int(i) for i in torch.nonzero((got != expected).any(-1))[0])
    table = tables[row].tolist()
    want_block, want_offset = table[pos // block_size], pos % block_size
    at = (
        f"out[{row}, {head}, {pos}] (row {row}, head {head}, position {pos}) should be slot "
        f"{want_block * block_size + want_offset}: offset {pos} % {block_size} = {want_offset} of block "
        f"table[{row}][{pos} // {block_size}] = {want_block}"
    )
    found = torch.nonzero((slots == got[row, head, pos]).all(-1))
    if not len(found):
        return f"{at}; it holds values found nowhere in the pool" + (
            " (zeros: never filled)" if not bool(got[row, head, pos].any()) else ""
        )
    slot, from_head = (int(i) for i in found[0])
    block, offset = divmod(slot, block_size)
    at += f"; it holds slot {slot} (offset {offset} of block {block})"
    if from_head != head:
        return (
            f"{at}, head {from_head}'s values: the heads got mixed with the positions — a reshape to "
            "[B, KV, S, D] does not move the heads axis; reshape to [B, S, KV, D], then transpose"
        )
    if slot == want_block:
        return f"{at}: the block id used as a slot; block b's slots are b*block_size .. b*block_size + block_size - 1"
    if block == want_block:
        return f"{at}: the right block, the wrong offset; position p is at offset p % block_size of its block"
    if offset == want_offset and block in table:
        return (
            f"{at}: the right offset in the wrong block, table entry {table.index(block)} instead of entry "
            f"{pos // block_size}; position p is in block table[p // block_size]"
        )
    j = pos // block_size
    other = next((r for r, t in enumerate(tables.tolist()) if r != row and t[j] == block), None)
    if offset == want_offset and other is not None:
        return f"{at}, row {other}'s block (table[{other}][{j}]): each row reads the blocks of its own table"
    if block in table:
        same = torch.equal(got[row, head].flatten().sort().values, expected[row, head].flatten().sort().values)
        return f"{at}, table entry {table.index(block)}" + (
            f": row {row} holds the right values in the wrong order — position p is offset p % block_size of "
            "block table[p // block_size] (all of a block's slots, then the next block's)"
            if same
            else ""
        )
    return f"{at}, a block that row {row}'s table {table} does not list"


@check
def check_gather_kv(gather_kv, model: str = DEFAULT_MODEL) -> str:
    """``gather_kv(slots[num_slots, KV, D], block_tables[B, n], block_size) -> [B, KV, n*block_size, D]``."""
    gen = torch.Generator().manual_seed(3)
    block_size, kv, d = 4, 2, 3
    slots = torch.randn(10 * block_size, kv, d, generator=gen)
    tables = torch.tensor([[7, 2, 9], [0, 5, 5]])
    expected = slots.view(10, block_size, kv, d)[tables].reshape(2, 3 * block_size, kv, d).transpose(1, 2)
    given = tables.clone()
    got = gather_kv(slots, given, block_size)
    if not torch.equal(given, tables):
        raise CheckFailed(
            f"gather_kv changed the block_tables it was given, from {tables.tolist()} to {given.tolist()}: the "
            "engine passes the same tables to every layer; compute indices into a new tensor"
        )
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (2, 3 * block_size, kv, d):
        raise CheckFailed(
            f"gather_kv returned shape {tuple(got.shape)} = [B, S, KV, D]; attention wants heads before "
            "positions: transpose to [B, KV, S, D]"
        )
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (2, 3, kv, d):
        raise CheckFailed(
            "gather_kv returned one slot per block table entry: a table lists *blocks*; block b holds the "
            "block_size slots b*block_size .. b*block_size + block_size - 1"
        )
    what = "gather_kv(slots, [[7, 2, 9], [0, 5, 5]], block_size=4)"
    if isinstance(got, torch.Tensor) and got.shape == expected.shape:
        in_order = slots.view(10, block_size, kv, d)[tables.sort(dim=1).values]
        if not torch.equal(tables.sort(dim=1).values, tables) and torch.equal(
            got, in_order.reshape(2, 3 * block_size, kv, d).transpose(1, 2)
        ):
            raise CheckFailed(
                "gather_kv read the blocks in id order, not in block-table order: position p is in table[p // block_size]"
            )
        if got.dtype == slots.dtype and not torch.equal(got, expected):
            raise CheckFailed(f"{what} differs from the reference: {_gather_mistake(got, slots, tables, block_size)}")
    if isinstance(got, torch.Tensor) and got.dim() == 4 and got.shape[:2] == expected.shape[:2]:
        if got.shape[2] != expected.shape[2] and got.shape[3] == d:
            raise CheckFailed(
                f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}: {got.shape[2]} positions per "
                f"row, where the rows' tables list 3 blocks of block_size=4 slots each"
            )
    compare_tensors(got, expected, what)
    half = gather_kv(slots.to(torch.bfloat16), tables.clone(), block_size)
    if isinstance(half, torch.Tensor) and half.dtype != torch.bfloat16:
        raise CheckFailed(
            f"gather_kv returned {half.dtype} from bfloat16 slots: K/V must keep the pool's dtype (the engine's "
            "pool is often bf16); create any buffer with dtype=slots.dtype, device=slots.device"
        )
    compare_tensors(half, expected.to(torch.bfloat16), f"{what} on bfloat16 slots")

    from minillm.course.plugs import gather_from_pool

    run_scattered(
        model,
        {"gather_kv": gather_from_pool(gather_kv)},
        "the paged engine reading K/V through your gather",
        "block j of a row is block_tables[row, j]; keep the table's order",
    )
    return (
        f"every attention layer of the paged engine read its K/V through your gather: {len(PROMPTS)} requests "
        "with scattered blocks match the contiguous cache"
    )


@contextlib.contextmanager
def _builtin_hash_calls():
    """Record every call of the built-in ``hash()`` this thread makes inside the ``with`` (a
    learner's helper functions included). A profile hook (``sys.setprofile``, per thread) sees each
    call of a built-in function; nothing is replaced, so other threads and code are untouched."""
    calls: list = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "c_call" and arg is builtins.hash:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


@check
def check_block_hash(block_hash, model: str = DEFAULT_MODEL) -> str:
    """``block_hash(parent_hash, token_ids) -> int``: a full block's name, chained to its prefix."""

    def call(parent, tokens, why=lambda: ""):
        """``block_hash(parent, tokens)``; when it raises, say which call and (``why()``) what it shows."""
        try:
            return block_hash(parent, tokens)
        except Exception as err:
            cause = learner_cause(err)
            if cause is None or isinstance(cause, NotImplementedError):
                raise
            shown = str(parent) if len(str(parent)) <= 24 else f"{str(parent)[:20]}..."
            raise CheckFailed(
                f"block_hash({shown}, {list(tokens)}) raised {type(cause).__name__}: {cause}{why()}"
            ) from None

    def none_parent():
        try:
            block_hash(12345, [1, 2, 3, 4])
        except Exception:
            return ""
        return " — it works with parent_hash=12345: a sequence's first block has parent_hash None; hash a stand-in for it (e.g. 0)"

    tokens = [1, 2, 3, 4]
    with _builtin_hash_calls() as hashed:
        a = call(None, tokens, none_parent)
    builtin = (
        "block_hash uses Python's built-in hash(): it is not stable across processes (hash(None) and "
        "str hashes change per process before Python 3.12), so two workers would name the same prefix "
        "differently. Use a real hash function over bytes (hashlib) and return an int"
    )
    if hashed:
        raise CheckFailed(builtin)
    if isinstance(a, (bytes, bytearray)):
        raise CheckFailed(
            f"block_hash returned {type(a).__name__} {a!r:.40}: .digest() returns bytes, and block_hash must "
            "return an int (the next block's parent_hash) — take its first 8 bytes as one: "
            "int.from_bytes(h.digest()[:8], 'little')"
        )
    if not isinstance(a, int) or isinstance(a, bool):
        raise CheckFailed(f"block_hash should return an int, got {type(a).__name__}")
    if tokens != [1, 2, 3, 4]:
        raise CheckFailed(
            f"block_hash changed the token list it was given, from [1, 2, 3, 4] to {tokens}: the tokens belong to "
            "the sequence; hash them (and the parent) without changing them"
        )
    if block_hash(None, [1, 2, 3, 4]) != a or block_hash(None, (1, 2, 3, 4)) != a:
        raise CheckFailed("block_hash gave different results for the same tokens: hash a tuple of them")
    if block_hash(None, [4, 3, 2, 1]) == a:
        raise CheckFailed("block_hash ignores the order of the tokens")
    for i in range(4):
        changed = [1, 2, 3, 4]
        changed[i] += 10
        if block_hash(None, changed) == a:
            raise CheckFailed(
                f"block_hash gave {changed} the same hash as [1, 2, 3, 4]: it ignores token {i} of the block; "
                "hash every token"
            )
    big = [50000, 100000, 7, 3]
    call(
        None,
        big,
        lambda: (
            " — yet [1, 2, 3, 4] hashed fine: token ids go up to the vocabulary size (100000 and more); "
            "give each token enough bytes (8, as struct format 'q' packs it)"
        ),
    )
    if block_hash(None, [1, 23, 4, 5]) == block_hash(None, [12, 3, 4, 5]):
        raise CheckFailed(
            "blocks [1, 23, 4, 5] and [12, 3, 4, 5] got the same hash: their tokens' digits written one after "
            "another are the same text; separate the tokens, or pack each in a fixed number of bytes"
        )

    def own_parent(parent):
        def why():
            size = f"a {parent.bit_length()}-bit int" + (", negative" if parent < 0 else "")
            return (
                f" — parent_hash is a hash your function returned ({size}): block_hash must take its own results "
                "as parents; return a non-negative int of at most 64 bits (e.g. the first 8 bytes of the digest)"
            )

        return why

    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    h1, h2 = block_hash(None, first), block_hash(None, second)
    if call(h1, second, own_parent(h1)) == call(h2, first, own_parent(h2)):
        raise CheckFailed(
            "two blocks in swapped order got the same chained hash (as XOR-ing the parent with the block's "
            "hash does): hash the parent together with the tokens, so the chain depends on block order"
        )
    code = getattr(getattr(block_hash, "__wrapped__", block_hash), "__code__", None)
    if code is not None and "hash" in code.co_names and "hashlib" not in code.co_names:
        raise CheckFailed(builtin)
    if block_hash(a, [5, 6, 7, 8]) == block_hash(None, [5, 6, 7, 8]) or block_hash(a, [5, 6, 7, 8]) == block_hash(
        block_hash(None, [0, 0, 0, 0]), [5, 6, 7, 8]
    ):
        raise CheckFailed(
            "the same tokens after different prefixes got the same hash: include parent_hash in what you hash, "
            "so a block's name stands for its whole prefix (its K/V depend on everything before it)"
        )
    _check_hash_width(block_hash)
    prompts = [SYSTEM + p for p in PROMPTS[:3]]
    engine = paged_engine(model, block_size=8)
    with hooks.override(block_hash=block_hash):
        first = run_all(engine, prompts[:1])
        rest = run_all(engine, prompts[1:])
    compare_request_tokens(
        first | rest,
        contiguous_reference(model, tuple(prompts)),
        "requests with a cached prefix",
        "hash (parent_hash, tuple(token_ids))",
    )
    hits = [o.num_cached_tokens for o in rest.values()]
    if min(hits) == 0:
        raise CheckFailed("later requests sharing the system prompt found nothing in the prefix cache")
    assert_pool_clean(engine)
    return (
        f"with your hash, requests sharing the {len(engine.tokenizer.encode(SYSTEM))}-token system prompt reused "
        f"{hits} of their prompt tokens from the cache, tokens identical to recomputing them"
    )


def _check_hash_width(block_hash, blocks: int = 512) -> None:
    """A block's name must have room for every block a server ever caches: hashes cut to 4 bytes
    take 2^32 values, and among ~77,000 blocks two share a name with even odds (the birthday
    bound) — the second request then reads the first one's K/V. 512 names of a 56-bit-or-wider
    hash reach past 2^48 with near certainty; a narrower one never does."""
    names = [block_hash(None, [n, n + 1, n + 2, n + 3]) for n in range(blocks)]
    bits = max(int(h).bit_length() for h in names)
    if len(set(names)) < blocks:
        raise CheckFailed(
            f"{blocks - len(set(names))} of {blocks} different blocks got a name another block already had: "
            "two prefixes that share a name share their cached K/V; keep 8 bytes of the digest"
        )
    if bits <= 48:
        bytes_kept = (bits + 7) // 8
        pairs = f"{math.sqrt(2 * math.log(2) * 2**bits):,.0f}"  # 50% odds of a shared name
        raise CheckFailed(
            f"your hashes fit in {bits} bits (about {bytes_kept} bytes of the digest): among {pairs} cached blocks "
            "two share a name with even odds (the birthday bound), and a request would read another prefix's K/V; "
            "keep 8 bytes: int.from_bytes(h.digest()[:8], 'little')"
        )
