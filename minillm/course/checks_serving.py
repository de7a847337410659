"""Checks for chapters 03 (paged KV cache) and 04 (batching).

Each plugs the learner's function into the paged engine — the slot mapping into the model
runner, the hash and the block allocator into the block manager, the scheduling step into the
scheduler — runs real requests through it (under memory pressure, with shared prefixes,
with requests arriving mid-run) and compares every request's tokens with the contiguous-cache
engine of chapter 02.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import math
import numbers
import sys
import types

import torch

import minillm.hooks as hooks
from minillm.course.checks import DEFAULT_MODEL
from minillm.course.compare import compare_tensors, int_cases
from minillm.course.results import CheckError, CheckFailed, check, learner_cause

PROMPTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?",
    "HAMLET.\nTo be, or not to be, that is the question.",
    "KING.\nNow is the winter of our discontent",
    "FOOL.\nThe more",
]
SYSTEM = "You are a courtly poet of the Globe Theatre. Answer in blank verse, briefly, with wit and grace.\n"
MAX_TOKENS = 24


def _params():
    from minillm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@functools.lru_cache(maxsize=4)
def contiguous_reference(model: str, prompts: tuple[str, ...]) -> list[list[int]]:
    """Each prompt alone through the contiguous-cache engine (chapter 02's rung)."""
    from minillm import LLM

    llm = LLM(model, dtype="fp32", mode="contiguous", attention_backend="torch")
    return [llm.generate(p, _params())[0].token_ids for p in prompts]


def paged_engine(model: str, **kwargs):
    from minillm import LLMEngine

    return LLMEngine(model, dtype="fp32", attention_backend="torch", **kwargs)


def pool_bytes(engine_model: str, blocks: int, block_size: int) -> int:
    from minillm.assets import resolve_model
    from minillm.config import ModelConfig
    from minillm.kvcache.addressing import kv_bytes_per_token

    config = ModelConfig.from_folder(resolve_model(engine_model))
    return blocks * block_size * kv_bytes_per_token(config, torch.float32)


def run_all(engine, prompts, max_steps: int = 2000) -> dict:
    """Add every prompt, step to completion; outputs by request id. Fails on a hang or loss."""
    ids = [engine.add_request(p, _params()) for p in prompts]
    done: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            if d.output is not None:
                if d.request_id in done:
                    raise CheckFailed(f"request {d.request_id} finished twice")
                done[d.request_id] = d.output
    else:
        stuck = [i for i in ids if i not in done]
        raise CheckFailed(f"after {max_steps} steps requests {stuck} had still not finished: the engine is stuck")
    return {i: done[i] for i in ids}


def compare_request_tokens(outputs: dict, expected: list[list[int]], what: str, hint: str) -> None:
    for n, (out, ref) in enumerate(zip(outputs.values(), expected)):
        got = out.token_ids
        if got != ref:
            i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            raise CheckFailed(
                f"{what}: request {n} ({PROMPTS[n % len(PROMPTS)][:20]!r}...) differs from the reference at "
                f"token {i} (got {got[i : i + 3]}, expected {ref[i : i + 3]}). Hint: {hint}"
            )


def _run_scattered(model: str, hook: dict, what: str, hint: str) -> None:
    """Every prompt through a paged engine whose free list is scattered (a sequence's blocks
    are not adjacent in the pool), with ``hook`` = {hook name: the learner's function} in
    place; each request must match the contiguous cache."""
    engine = paged_engine(model, block_size=4)
    engine.block_manager.free_ids.rotate(7)
    with hooks.override(**hook):
        outputs = run_all(engine, PROMPTS)
    compare_request_tokens(outputs, contiguous_reference(model, tuple(PROMPTS)), what, hint)


def assert_pool_clean(engine) -> None:
    try:
        engine.block_manager.check_invariants()
    except AssertionError as err:
        raise CheckFailed(f"the block manager's bookkeeping is broken: {err}") from None
    used = engine.stats().kv_blocks_used
    if used:
        raise CheckFailed(f"{used} blocks are still referenced after every request finished: a leak")


# ---------------------------------------------------------------------------------------------
# Chapter 03: the paged KV cache
# ---------------------------------------------------------------------------------------------


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


@check
def check_slot_mapping(slot_mapping, model: str = DEFAULT_MODEL) -> str:
    """``slot_mapping(block_table, start, num_tokens, block_size) -> list[int]``: pool slots of positions."""
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
    _run_scattered(
        model,
        {"slot_mapping": slot_mapping},
        "the engine writing K/V through your slot mapping",
        "check positions that cross a block boundary",
    )
    return f"the paged engine wrote every K/V through your slot mapping: {len(PROMPTS)} requests match the contiguous cache"


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

    _run_scattered(
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


# ---------------------------------------------------------------------------------------------
# Chapter 04: batching
# ---------------------------------------------------------------------------------------------


def run_arriving(engine, prompts, priorities=None, on_step=None, max_steps: int = 3000) -> dict:
    """Two requests now, the rest one per step while others run; outputs by request id."""
    priorities = priorities or [0] * len(prompts)
    pending = list(zip(prompts, priorities))
    ids, done = [], {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests() and not pending:
            break
        for _ in range(2 if not ids else 1):
            if pending:
                prompt, priority = pending.pop(0)
                ids.append(engine.add_request(prompt, _params(), priority=priority))
        for d in engine.step():
            if d.output is not None:
                done[d.request_id] = d.output
    else:
        raise CheckFailed(
            f"after {max_steps} steps requests {[i for i in ids if i not in done]} were unfinished: the engine "
            "is stuck (does every step schedule the running sequences?)"
        )
    return {i: done[i] for i in ids}


def _chunk_rule(remaining: int, budget: int, chunked_prefill: bool, step_is_empty: bool) -> int:
    if chunked_prefill:
        return min(remaining, budget)
    return remaining if remaining <= budget or step_is_empty else 0


def _chunk_tokens_mix_up(chunk_tokens, cases) -> None:
    """Fail naming the mix-up when every answer is the rule's with two arguments swapped or
    the chunking flag read backwards, or when the first wrong answer cuts a prompt without
    chunked prefill (else ``int_cases`` names the first wrong case)."""
    try:
        got = [chunk_tokens(*args) for *args, _, _ in cases]
    except Exception:
        return  # int_cases reports the call that raised
    if got == [expected for *_, expected, _ in cases]:
        return
    mix_ups = [
        (
            lambda r, b, c, e: _chunk_rule(r, b, not c, e),
            "the rule with chunked_prefill read backwards: you cut prompts into chunks when chunked_prefill is "
            "False and run them whole when it is True",
        ),
        (
            lambda r, b, c, e: _chunk_rule(r, b, e, c),
            "the rule with chunked_prefill and step_is_empty swapped: the arguments come in the order "
            "(remaining, budget, chunked_prefill, step_is_empty)",
        ),
        (
            lambda r, b, c, e: _chunk_rule(b, r, c, e),
            "the rule with remaining and budget swapped: the arguments come in the order "
            "(remaining, budget, chunked_prefill, step_is_empty)",
        ),
    ]
    for rule, what in mix_ups:
        if got == [rule(*args) for *args, _, _ in cases]:
            raise CheckFailed(f"chunk_tokens returned {got} on the {len(cases)} test calls: that is {what}")
    (remaining, budget, chunked, empty, _, _), n = next((c, n) for c, n in zip(cases, got) if n != c[4])
    if not chunked and isinstance(n, int) and 0 < n < remaining:
        call = f"remaining={remaining}, budget={budget}, chunked_prefill=False, step_is_empty={empty}"
        raise CheckFailed(
            f"chunk_tokens({call}) returned {n}, part of the prompt: without chunked prefill a prompt is never cut "
            f"— it runs whole ({remaining}) or waits for a later step (0)"
            + (", and alone in an empty step it runs whole even past the budget" if empty else "")
        )


@check
def check_chunk_tokens(chunk_tokens, model: str = DEFAULT_MODEL) -> str:
    """``chunk_tokens(remaining, budget, chunked_prefill, step_is_empty) -> int``: how many of a
    sequence's uncomputed tokens run this step."""
    cases = [
        # remaining, budget, chunked, empty step, expected, why
        (1, 16, True, False, 1, "a decode needs one token"),
        (40, 16, True, False, 16, "with chunked prefill a long prompt takes what is left of the budget"),
        (10, 16, True, False, 10, "never more than the sequence still needs"),
        (40, 0, True, False, 0, "an exhausted budget runs nothing"),
        (10, 16, False, False, 10, "a prompt that fits runs whole"),
        (16, 16, False, False, 16, "a prompt exactly the size of the budget fits"),
        (40, 16, False, False, 0, "without chunking a prompt that does not fit waits for a later step"),
        (
            40,
            16,
            False,
            True,
            40,
            "without chunking, a prompt larger than the whole budget runs alone in an empty step (else it would wait forever)",
        ),
        (
            40,
            5,
            False,
            True,
            40,
            "without chunking, a prompt larger than the whole budget runs alone in an empty step (else it would wait forever)",
        ),
        (
            40,
            16,
            True,
            True,
            16,
            "with chunked prefill even the first sequence of a step takes no more than the budget",
        ),
    ]
    _chunk_tokens_mix_up(chunk_tokens, cases)
    int_cases(chunk_tokens, "chunk_tokens", cases, ("remaining", "budget", "chunked_prefill", "step_is_empty"))

    from minillm.course.plugs import tokens_to_run as plug

    tokens_to_run = plug(chunk_tokens)  # hook tokens_to_run's signature
    steps = []
    for chunked in (True, False):
        engine = paged_engine(model, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=chunked)
        with hooks.override(tokens_to_run=tokens_to_run):
            outputs = run_arriving(engine, PROMPTS)
        compare_request_tokens(
            outputs,
            contiguous_reference(model, tuple(PROMPTS)),
            f"requests with an 8-token budget, chunked_prefill={chunked}, on your chunk_tokens",
            "the budget is shared by the whole step",
        )
        steps.append(engine.stats().num_steps)
    return (
        f"with an 8-token budget every prompt ran in chunks ({steps[0]} steps) or, unchunked, whole and alone "
        f"when too long ({steps[1]} steps); all {len(PROMPTS)} requests match running each alone"
    )


class _Seq:
    """A stand-in sequence for unit cases: only what the victim choice may look at."""

    def __init__(self, name: str, priority: int, arrival: float):
        self.name, self.sort_key = name, (priority, arrival, 0)
        self.priority, self.metrics = priority, types.SimpleNamespace(arrival_time=arrival)

    def __repr__(self) -> str:
        return self.name


@check
def check_choose_victim(choose_victim, model: str = DEFAULT_MODEL) -> str:
    """``choose_victim(seq, candidates) -> Sequence``: who is preempted so that ``seq`` can grow."""
    a, b, c = (
        _Seq("A(priority 0, arrived 1st)", 0, 1.0),
        _Seq("B(priority 0, arrived 2nd)", 0, 2.0),
        _Seq("C(priority 0, arrived 3rd)", 0, 3.0),
    )
    low = _Seq("L(priority 5, arrived 0th)", 5, 0.5)
    urgent = _Seq("U(priority -1, arrived 4th)", -1, 4.0)
    cases = [
        (a, [b, c], c, "the latest arrival among equals is preempted (it has waited least; FCFS)"),
        (a, [c, b], c, "the choice must not depend on the order of the candidates"),
        (c, [a, low], low, "a lower priority (a larger priority number) goes first, whenever it arrived"),
        (b, [a], b, "every candidate outranks seq: seq preempts itself rather than an earlier request"),
        (urgent, [a, b], b, "an urgent request takes blocks from the lowest-ranked running one"),
        (a, [], a, "with no candidate left, seq itself must yield"),
    ]
    for seq, candidates, expected, why in cases:
        call = f"choose_victim({seq}, {candidates})"
        try:
            got = choose_victim(seq, list(candidates))
        except Exception as err:
            cause = learner_cause(err)
            if candidates or cause is None or isinstance(cause, NotImplementedError):
                raise
            raise CheckFailed(
                f"{call} raised {type(cause).__name__}: {cause} — with no candidate left, seq itself must yield: "
                "return seq when candidates is empty"
            ) from None
        if got is not expected:
            if got is not seq and not any(got is c for c in candidates):
                raise CheckFailed(
                    f"{call} returned {got!r}, which is neither seq nor one of the candidates: return the sequence "
                    f"to preempt itself (here {expected}), not its position or id"
                )
            if got is seq:
                why += f"; you returned seq itself, yet {expected} ranks below it — seq yields only when every candidate outranks it"
            elif expected is seq and got.sort_key[0] == seq.sort_key[0]:
                why += (
                    f" (with equal priorities the earlier arrival, {got}, outranks {seq}: compare the whole sort_key)"
                )
            raise CheckFailed(f"{call} returned {got!r}, expected {expected}: {why}")
    engine = paged_engine(
        model, block_size=4, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory=pool_bytes(model, 24, 4)
    )
    victims = []

    def chooser(scheduler, seq, candidates):  # hook choose_victim's signature
        victim = choose_victim(seq, candidates)
        if victim is not seq and victim not in candidates:
            raise CheckFailed(f"choose_victim returned {victim!r}, which is neither seq nor one of the candidates")
        victims.append(victim.priority)
        return victim

    priorities = [1, 0, 1, 0, 2]
    with hooks.override(choose_victim=chooser):
        outputs = run_arriving(engine, PROMPTS, priorities)
    compare_request_tokens(
        outputs,
        contiguous_reference(model, tuple(PROMPTS)),
        "requests preempted by your choice",
        "a preempted request recomputes its tokens later; the choice only decides who waits",
    )
    assert_pool_clean(engine)
    if not victims:
        raise CheckError("the workload was meant to run out of blocks, but nothing was preempted")
    return (
        f"a 24-block pool ran out {len(victims)} times; your choice preempted requests of priority "
        f"{sorted(set(victims))} and every request still matches running alone"
    )


def _check_budget_spent(scheduler, out, limit: int) -> None:
    """With chunked prefill a prompt's chunk is cut short only by the budget running out: a step
    that left budget unused while a scheduled prompt still had tokens to compute lost it somewhere —
    most often to a ``reserve`` that returned False (the sequence was preempted itself to free
    blocks: nothing was scheduled for it) and whose tokens were taken off the budget anyway."""
    from minillm.sequence import SequenceStatus

    unused = limit - out.num_tokens
    if not scheduler.enable_chunked_prefill or unused <= 0:
        return
    for chunk in out.chunks:
        seq = chunk.seq
        after = len(seq) - (chunk.start + chunk.num_tokens)
        if seq.status is SequenceStatus.RUNNING and seq not in out.admitted and after > 0:
            itself = [q for q in out.preempted if q not in {c.seq for c in out.chunks}]
            cause = (
                f" In this step scheduler.reserve preempted request {itself[0].request_id} itself to free blocks "
                "and returned False: nothing was scheduled for it, so its tokens must stay in the budget — take n "
                "off the budget only when reserve returns True"
                if itself
                else ""
            )
            raise CheckFailed(
                f"a step scheduled {out.num_tokens} of its {limit} budget tokens, and request {seq.request_id}'s "
                f"prompt chunk of {chunk.num_tokens} left {after} of its tokens for later: {unused} budget tokens "
                f"went unused.{cause}"
            )


class _WithBudget:
    """The scheduler as one hand-made step shows it to the learner's ``schedule_continuous``: the
    same scheduler (every method and list is its own) with another token budget for that step."""

    def __init__(self, scheduler, max_num_batched_tokens: int):
        self._scheduler = scheduler
        self.max_num_batched_tokens = max_num_batched_tokens

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


@check
def check_continuous_schedule(schedule_continuous, model: str = DEFAULT_MODEL) -> str:
    """``schedule_continuous(scheduler) -> SchedulerOutput``: one continuous-batching step."""
    from minillm.sequence import SequenceStatus

    budget = 16
    engine = paged_engine(
        model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4, kv_cache_memory=pool_bytes(model, 24, 4)
    )
    steps = []
    queue: list = []  # the waiting sequences in order, as the current step began
    tried: list = []  # those try_admit was called for in the current step

    def schedule(self, now):  # hook schedule's signature: (scheduler, now)
        waiting = self.waiting_in_order()
        ranked = self.running_in_order()
        decodes = [q for q in self.running if q.is_decoding]
        queue[:], tried[:] = waiting, []
        out = schedule_continuous(self)
        if out is None:
            raise CheckFailed("schedule_continuous returned None: return the SchedulerOutput you filled")
        limit = self.max_num_batched_tokens
        if out.num_tokens > limit:
            new = sum(c.num_tokens for c in out.chunks if c.seq in out.admitted)
            old = out.num_tokens - new
            fix = (
                "pass tokens_to_run what is left of the budget and take each running sequence's tokens off it"
                if old > limit
                else f"the running sequences left {limit - old}; newcomers get only what is left — pass try_admit "
                "the budget left and take each newcomer's tokens off it"
            )
            raise CheckFailed(
                f"a step scheduled {out.num_tokens} tokens, over the budget of {limit} ({old} for running "
                f"sequences, {new} for newly admitted ones): {fix}"
            )
        _check_budget_spent(self, out, limit)
        if len(self.running) > self.max_num_seqs:
            raise CheckFailed(
                f"{len(self.running)} sequences running, more than max_num_seqs={self.max_num_seqs}: admit only "
                "while len(scheduler.running) < max_num_seqs"
            )
        for chunk in out.chunks:
            if chunk.seq.status is not SequenceStatus.RUNNING:
                raise CheckFailed(
                    f"a step scheduled request {chunk.seq.request_id} after it had been preempted in the same step: "
                    "skip running sequences whose status is no longer RUNNING"
                )
        if out.preempted and out.admitted:
            raise CheckFailed(
                f"a step preempted {len(out.preempted)} request(s) to find blocks, then admitted "
                f"{len(out.admitted)} new one(s): admitting while evicting only evicts more — admit only in a step "
                "that preempted nothing"
            )
        if out.admitted != waiting[: len(out.admitted)]:
            first = next(q for q in waiting if q not in out.admitted)
            raise CheckFailed(
                f"not first come, first served: the step admitted request {out.admitted[-1].request_id} while "
                f"request {first.request_id}, ahead of it in the queue, still waited — stop at the first request "
                "that does not fit"
            )
        scheduled = {c.seq for c in out.chunks}
        prefilled = [c.seq for c in out.chunks if c.seq not in out.admitted and not c.seq.is_decoding]
        starved = [q for q in decodes if q not in scheduled and q.status is SequenceStatus.RUNNING]
        if starved and prefilled:
            raise CheckFailed(
                f"request {starved[0].request_id} waited on its next token while a prompt chunk used the budget: "
                "schedule decodes first (scheduler.running_in_order())"
            )
        left = [q for q in ranked if q not in scheduled and q.status is SequenceStatus.RUNNING]
        if left and self.enable_chunked_prefill:  # (without chunking a prompt that does not fit may wait)
            unused = limit - out.num_tokens
            if unused and not any(q in scheduled for q in ranked):
                raise CheckFailed(
                    f"the step gave none of the running requests {[q.request_id for q in left]} a token, with "
                    f"{unused} of its {limit} budget tokens unused: they stay unfinished — each step first gives the "
                    "running sequences their tokens (decodes first), then admits newcomers"
                )
            first = left[0]
            state = (
                "decoding"
                if first.is_decoding
                else f"prefilling, {len(first) - first.num_computed_tokens} tokens still to compute"
            )
            if unused:
                raise CheckFailed(
                    f"request {first.request_id} is running ({state}), but the step left it out with {unused} of its "
                    f"{limit} budget tokens unused: every running sequence — decodes, then prompts still being "
                    "prefilled — gets tokens while the budget lasts"
                )
            behind = next((q for q in ranked[ranked.index(first) + 1 :] if q in scheduled), None)
            if behind is not None:
                raise CheckFailed(
                    f"request {first.request_id} ({state}) was left out of a full step while request "
                    f"{behind.request_id}, behind it in scheduler.running_in_order() (decodes first, then by priority "
                    "and arrival), got tokens: go through the running sequences in that order"
                )
        steps.append(out)
        return out

    original_reserve, original_admit, original_tokens = (
        hooks.current(n) for n in ("reserve", "try_admit", "tokens_to_run")
    )
    refused: list = []  # sequences try_admit could not start in the current step
    admitting: list = []  # inside try_admit (which may look at a waiting, preempted sequence)

    def skipped_preempted(seq, what):
        raise CheckFailed(
            f"{what} was called for request {seq.request_id}, which was preempted earlier in the same step: "
            "skip running sequences whose status is no longer RUNNING"
        )

    def tokens_to_run(self, seq, budget_left, out):
        if seq in out.preempted and not admitting:
            skipped_preempted(seq, "scheduler.tokens_to_run")
        return original_tokens(self, seq, budget_left, out)

    def reserve(self, seq, n, out, drafts=()):
        if seq.status is not SequenceStatus.RUNNING:
            skipped_preempted(seq, "scheduler.reserve")
        if out.admitted and seq not in out.admitted:
            raise CheckFailed(
                f"the step admitted request {out.admitted[0].request_id} before scheduling running request "
                f"{seq.request_id}: schedule the running sequences first (decodes first), then admit newcomers "
                "with the budget, seats and blocks left"
            )
        return original_reserve(self, seq, n, out, drafts)

    def try_admit(self, seq, budget_left, out):
        if out.preempted:
            raise CheckFailed(
                f"a step preempted request {out.preempted[0].request_id} to find blocks, then tried to admit "
                f"request {seq.request_id}: admitting while evicting only evicts more — admit only in a step that "
                "preempted nothing"
            )
        if refused:
            raise CheckFailed(
                f"not first come, first served: request {refused[0].request_id} did not fit, and the step went on to "
                f"try request {seq.request_id} behind it — stop at the first request that does not fit"
            )
        if len(tried) < len(queue) and seq is not queue[len(tried)]:
            head = queue[len(tried)]
            raise CheckFailed(
                f"not first come, first served: the step tried to admit request {seq.request_id} before request "
                f"{head.request_id}, ahead of it in scheduler.waiting_in_order() (priority, then arrival; a preempted "
                "request keeps its place): admit from the head of that queue, in order"
            )
        tried.append(seq)
        admitting.append(seq)
        try:
            n = original_admit(self, seq, budget_left, out)
        finally:
            admitting.pop()
        if n == 0:
            refused.append(seq)
        return n

    next_budget: list[int] = []  # a hand-made step's token budget (the engine's own stays as built)

    def schedule_step(self, now):
        refused.clear()
        return schedule(_WithBudget(self, next_budget.pop()) if next_budget else self, now)

    with hooks.override(schedule=schedule_step, reserve=reserve, try_admit=try_admit, tokens_to_run=tokens_to_run):
        done = run_arriving(engine, PROMPTS)
    joined = [out for out in steps if out.admitted and any(c.seq not in out.admitted for c in out.chunks)]
    if not joined:
        raise CheckFailed(
            "no request ever joined while others were running: that is static batching. Admit waiting "
            "sequences in the same step as the running ones, while seats, budget and blocks last"
        )
    compare_request_tokens(
        done,
        contiguous_reference(model, tuple(PROMPTS)),
        "requests under your scheduler",
        "schedule decodes first, then admit in FCFS order",
    )
    assert_pool_clean(engine)
    preemptions = sum(o.num_preemptions for o in done.values())
    if not preemptions:
        raise CheckError("the workload was meant to run out of blocks, but nothing was preempted")
    # A hand-made state: request 0 (priority 1) is ahead of the more urgent request 1 (priority 0) in
    # scheduler.running, both decoding, and one step has a budget of one token: it goes to request 1.
    small = paged_engine(model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    with hooks.override(schedule=schedule_step, reserve=reserve, try_admit=try_admit, tokens_to_run=tokens_to_run):
        for priority in (1, 0):
            small.add_request(PROMPTS[4], _params(), priority=priority)
            small.step()
        if [q.priority for q in small.scheduler.running] != [1, 0] or not all(
            q.is_decoding for q in small.scheduler.running
        ):
            raise CheckError("the hand-made state (two decoding requests, the less urgent first) was not reached")
        next_budget.append(1)
        small.step()
        # And one request decoding, one waiting, a budget of 2 (chunked prefill, the default): the decode
        # takes 1 token and the newcomer's prompt starts with a chunk of the 1 left.
        tight = paged_engine(model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
        tight.add_request(PROMPTS[4], _params())
        tight.step()
        decoding = tight.scheduler.running[0]
        if not decoding.is_decoding:
            raise CheckError("the hand-made state (one request decoding) was not reached")
        next_budget.append(2)
        tight.add_request(PROMPTS[3], _params())
        newcomer = tight.scheduler.waiting[0]
        tight.step()
        # And a full pool of 9 blocks: request A (priority 1) decodes into a new block while the more
        # urgent B still prefills its 33-token prompt. reserve preempts A itself (and returns False);
        # B's chunk takes the whole budget.
        from minillm import SamplingParams

        squeezed = paged_engine(model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4,
                                 kv_cache_memory=pool_bytes(model, 9, 4), enable_prefix_caching=False)  # fmt: skip
        squeezed.add_request(list(range(5, 17)), SamplingParams(max_tokens=12, ignore_eos=True), priority=1)
        for _ in range(2):
            squeezed.step()
        yielding = squeezed.scheduler.running[0]
        squeezed.add_request(list(range(7, 40)), SamplingParams(max_tokens=2, ignore_eos=True), priority=0)
        for _ in range(100):  # ~30 steps finish both; a scheduler that stalls must not hang the check
            if not squeezed.has_unfinished_requests():
                break
            squeezed.step()
        else:
            raise CheckFailed(
                "two requests in a 9-block pool were still unfinished after 100 steps under your scheduler: every "
                "step must give the running sequences tokens while the budget and the blocks last"
            )
        if not yielding.num_preemptions:
            raise CheckError("the hand-made state (a request that must preempt itself) was not reached")
    if newcomer.status is not SequenceStatus.RUNNING:
        raise CheckFailed(
            f"a step with a budget of 2 ran request {decoding.request_id}'s decode and left 1 token unused while "
            f"request {newcomer.request_id} waited: with chunked prefill a prompt may start "
            "with a chunk of a single token — admit while any budget is left (budget > 0)"
        )
    return (
        f"{len(PROMPTS)} requests arriving mid-run all finished under your scheduler, {len(joined)} steps admitted "
        f"newcomers next to running decodes, {preemptions} preemptions in a 24-block pool; tokens identical to "
        "running each alone"
    )
