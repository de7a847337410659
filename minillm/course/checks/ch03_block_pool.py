"""Chapter 03's whole piece: the block allocator as a class — ``BlockPool(num_blocks)`` with its
free list, reference counts, the prefix cache's hash table and the LRU of cached blocks.

The block manager builds its pool through ``hooks.block_pool`` and reads the pool's four
structures (``blocks``, ``free_ids``, ``cached``, ``evictable``) for its statistics; everything
else goes through six methods (``allocate``, ``ref``, ``release``, ``register``, ``lookup``,
``forget``). Two stages:

1. **diagnosis on hand-made pools** — pools of 2 to 4 blocks driven call by call: handing out
   and sharing blocks, a double free, naming a block and finding it again (and not finding it
   under another parent or other tokens: a hash collision is not a hit), a cached block kept
   after its last release, evicted only when the free list is empty and least recently used
   first, a hit that makes a cached block recent again, and a name forgotten; after every call
   the pool's bookkeeping is checked (a block is in exactly one place);
2. **the plug-in run** — the engine built on the learner's class (the tiny model, fp32) runs
   requests that share a system prompt in a pool too small for all of them: greedy tokens equal
   to the contiguous cache's, the prefix cache's hits equal to the package pool's, no leak.
"""

from __future__ import annotations

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.results import CheckError, CheckFailed, check, learner_cause, learner_function

LRU_HINT = "evictable is kept oldest first: release appends, a hit (ref) takes the block out, eviction pops the oldest"


METHODS = ("allocate", "ref", "release", "register", "lookup", "forget")


def _class_of(BlockPool) -> type:
    cls = getattr(BlockPool, "__wrapped__", BlockPool)  # the check hands the class over wrapped
    if not isinstance(cls, type):
        raise CheckFailed(f"pass your class, BlockPool itself (got {type(cls).__name__} {cls!r:.40})")
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise CheckFailed(f"your BlockPool has no method {', '.join(missing)}: the block manager calls "
                          f"{', '.join(METHODS)}")  # fmt: skip
    return cls


class GradedPool:
    """The learner's pool, built from their class, with each method's exceptions reported as
    theirs; the manager reads the four structures through it."""

    def __init__(self, cls: type, num_blocks: int):
        self.inner = learner_function(cls)(num_blocks)

    @property
    def blocks(self):
        return self.inner.blocks

    @property
    def free_ids(self):
        return self.inner.free_ids

    @property
    def cached(self):
        return self.inner.cached

    @property
    def evictable(self):
        return self.inner.evictable

    def allocate(self) -> int:
        return learner_function(self.inner.allocate)()

    def ref(self, block_id: int) -> None:
        learner_function(self.inner.ref)(block_id)

    def release(self, block_id: int) -> None:
        learner_function(self.inner.release)(block_id)

    def register(self, block_id: int, block_hash: int, parent_hash, token_ids) -> None:
        learner_function(self.inner.register)(block_id, block_hash, parent_hash, token_ids)

    def lookup(self, block_hash: int, parent_hash, token_ids):
        return learner_function(self.inner.lookup)(block_hash, parent_hash, token_ids)

    def forget(self, block_id: int) -> None:
        learner_function(self.inner.forget)(block_id)


def _raises_runtime_error(call, what: str, should: str) -> None:
    try:
        call()
    except Exception as err:
        raised = learner_cause(err) or err
        if not isinstance(raised, RuntimeError):
            raise CheckFailed(
                f"{what} raised {type(raised).__name__}: {raised}; {should} must raise RuntimeError"
            ) from None
    else:
        raise CheckFailed(f"{what} did not raise: {should} must raise RuntimeError")


def _bookkeeping(pool, where: str) -> None:
    """Every block in exactly one place, and the hash table agreeing with the blocks."""
    for name in ("blocks", "free_ids", "cached", "evictable"):
        if not hasattr(pool, name):
            raise CheckFailed(f"your BlockPool has no attribute {name!r}: the block manager reads blocks, free_ids, "
                              "cached and evictable (set them in __init__)")  # fmt: skip
    free, evictable = list(pool.free_ids), list(pool.evictable)
    if len(set(free)) != len(free):
        raise CheckFailed(f"{where}: a block is on the free list twice: {free}")
    for block in pool.blocks:
        b, places = block.block_id, []
        if block.ref_count > 0:
            places.append(f"referenced ({block.ref_count})")
        if block.ref_count < 0:
            raise CheckFailed(f"{where}: block {b} has ref_count {block.ref_count}")
        if b in free:
            places.append("on the free list")
        if b in evictable:
            places.append("evictable")
        if len(places) != 1:
            state = " and ".join(places) or "nowhere: not referenced, not free, not evictable (a leak)"
            raise CheckFailed(f"{where}: block {b} is {state}; a block is in exactly one of those places")
        if b in free and block.hash is not None:
            raise CheckFailed(f"{where}: block {b} is on the free list but still named {block.hash}: a free block "
                              "has no name (only evictable blocks keep theirs)")  # fmt: skip
        if b in evictable and block.hash is None:
            raise CheckFailed(
                f"{where}: block {b} is evictable but has no name: an unnamed block goes to the free list"
            )
    for h, b in dict(pool.cached).items():
        if pool.blocks[b].hash != h:
            raise CheckFailed(f"{where}: cached still maps hash {h} to block {b}, whose name is now "
                              f"{pool.blocks[b].hash}: when a block loses its name (evicted, forgotten) delete its "
                              "hash from cached too")  # fmt: skip
    named = {blk.block_id for blk in pool.blocks if blk.hash is not None}
    if named != set(dict(pool.cached).values()):
        raise CheckFailed(f"{where}: blocks {sorted(named - set(pool.cached.values()))} are still named (block.hash) "
                          "but cached no longer maps their hash: when a name goes, clear block.hash, parent_hash "
                          "and token_ids too")  # fmt: skip


def _allocate(pool, where: str) -> int:
    block_id = pool.allocate()
    if isinstance(block_id, bool) or not isinstance(block_id, int):
        raise CheckFailed(f"{where}: allocate returned {block_id!r:.40}, not a block id (an int)")
    if pool.blocks[block_id].ref_count != 1:
        raise CheckFailed(f"{where}: allocate returned block {block_id} with ref_count "
                          f"{pool.blocks[block_id].ref_count}: a block just handed out has one owner, ref_count 1")  # fmt: skip
    _bookkeeping(pool, where)
    return block_id


def _name(pool, block_id: int, h: int, parent=None, tokens=(1, 2)) -> None:
    pool.register(block_id, h, parent, list(tokens))
    _bookkeeping(pool, f"after register({block_id}, {h}, ...)")


def _hand_out(cls) -> None:
    pool = GradedPool(cls, 3)
    _bookkeeping(pool, "a new BlockPool(3)")
    taken = [_allocate(pool, f"allocation {i + 1} of 3") for i in range(3)]
    if sorted(taken) != [0, 1, 2]:
        raise CheckFailed(f"three allocations from a pool of 3 returned {taken}: each block is handed out once")
    _raises_runtime_error(pool.allocate, "allocate on a pool with no free or cached block", "running out")
    a, b, c = taken
    pool.ref(b)
    if pool.blocks[b].ref_count != 2:
        raise CheckFailed(f"ref({b}) left ref_count {pool.blocks[b].ref_count}: a second owner makes it 2")
    pool.release(b)
    _bookkeeping(pool, f"releasing block {b} once of its two owners")
    if b in pool.free_ids:
        raise CheckFailed(f"block {b}, shared by two owners, went back on the free list after one release: decrement "
                          "ref_count and free it only at 0")  # fmt: skip
    pool.release(b)
    pool.release(a)
    _bookkeeping(pool, f"releasing blocks {b} and {a}")
    if sorted(pool.free_ids) != sorted([a, b]):
        raise CheckFailed(f"after releasing blocks {b} and {a} the free list is {list(pool.free_ids)}")
    _raises_runtime_error(lambda: pool.release(a), f"releasing block {a} twice", "a double free")


def _names(cls) -> None:
    pool = GradedPool(cls, 3)
    x, y = _allocate(pool, "allocate"), _allocate(pool, "allocate")
    _name(pool, x, 1234, None, (5, 6))
    if pool.lookup(1234, None, [5, 6]) != x:
        raise CheckFailed(f"register({x}, 1234, None, [5, 6]) then lookup(1234, None, [5, 6]) gave "
                          f"{pool.lookup(1234, None, [5, 6])!r}, not block {x}")  # fmt: skip
    if pool.lookup(1234, None, (5, 6)) != x:
        raise CheckFailed("lookup with the tokens as a tuple missed: compare the tokens as tuples (tuple(token_ids))")
    if pool.lookup(1234, None, [5, 7]) is not None:
        raise CheckFailed("lookup(1234, None, [5, 7]) found the block named 1234 for [5, 6]: a hash collision is not "
                          "a hit — compare the block's stored token_ids too")  # fmt: skip
    if pool.lookup(1234, 99, [5, 6]) is not None:
        raise CheckFailed("lookup(1234, parent 99, [5, 6]) found the block registered under parent None: the same "
                          "tokens after another prefix hold other K/V — compare the stored parent_hash too")  # fmt: skip
    if pool.lookup(4321, None, [5, 6]) is not None:
        raise CheckFailed("lookup of a hash nobody registered should give None")
    _name(pool, x, 777, None, (5, 6))
    if pool.blocks[x].hash != 1234 or 777 in pool.cached:
        raise CheckFailed(f"block {x}, named 1234, was renamed 777 by a second register: a named block keeps its "
                          "name (the manager may register the same block again)")  # fmt: skip
    _name(pool, y, 1234, None, (5, 6))
    if pool.cached.get(1234) != x or pool.blocks[y].hash is not None:
        raise CheckFailed(f"register({y}, 1234, ...) took hash 1234 from block {x}: a hash that names a block "
                          "already keeps it (two blocks with the same content: the first stays the cached one)")  # fmt: skip
    pool.release(x)
    _bookkeeping(pool, f"releasing named block {x}")
    if x not in pool.evictable:
        raise CheckFailed(f"released block {x} has a name, so it goes to evictable (its K/V kept for a later hit), "
                          "not the free list")  # fmt: skip
    if pool.lookup(1234, None, [5, 6]) != x:
        raise CheckFailed(f"after its last release, block {x} is no longer found: a cached block stays named")
    _raises_runtime_error(lambda: pool.release(x), f"releasing cached block {x} again", "a double free")
    pool.ref(x)  # a prefix hit
    _bookkeeping(pool, f"ref({x}) of a cached block (a prefix hit)")
    if pool.blocks[x].ref_count != 1 or x in pool.evictable:
        raise CheckFailed(f"ref({x}) of an evictable block should make it referenced (ref_count 1) and take it out of "
                          "evictable, or it could be evicted while in use")  # fmt: skip
    pool.forget(x)
    _bookkeeping(pool, f"forget({x}) of a held block")
    if 1234 in pool.cached or pool.lookup(1234, None, [5, 6]) is not None:
        raise CheckFailed(f"after forget({x}) its hash still finds it: forget removes the name from cached too")
    pool.release(x)
    if x not in pool.free_ids:
        raise CheckFailed(f"block {x}, its name forgotten, should go to the free list at its last release")
    z = _allocate(pool, "allocate")
    _name(pool, z, 55, None, (1, 2))
    pool.release(z)
    pool.forget(z)
    _bookkeeping(pool, f"forget({z}) of an evictable block")
    if z not in pool.free_ids:
        raise CheckFailed(f"forget({z}) of an unreferenced cached block should move it to the free list")


def _eviction(cls) -> None:
    pool = GradedPool(cls, 2)
    first = _allocate(pool, "allocate")
    _name(pool, first, 1234)
    pool.release(first)
    second = _allocate(pool, "allocate with one free and one cached block")
    if second == first:
        raise CheckFailed("a cached block was evicted while the free list still had a block: evict only when it is "
                          "empty (the cached K/V may still be hit)")  # fmt: skip
    third = _allocate(pool, "allocate with only a cached block left")
    if third != first:
        raise CheckFailed(f"with the free list empty, allocate should evict the cached block {first}, got {third}")
    if 1234 in pool.cached or pool.blocks[first].hash is not None:
        raise CheckFailed(f"block {first} was evicted but keeps its name (in cached or block.hash): a later lookup "
                          "would find K/V that is being overwritten — forget its name when you evict it")  # fmt: skip
    pool = GradedPool(cls, 4)
    ids = [_allocate(pool, "allocate") for _ in range(4)]
    low, mid, high = sorted(ids[:3])
    for n, b in enumerate((low, mid, high)):
        _name(pool, b, 100 + n, None, (n, n))
    for b in (mid, high, low):
        pool.release(b)
    pool.ref(mid)  # a prefix hit makes mid the most recently used once it is released again
    pool.release(mid)
    _bookkeeping(pool, f"releasing {mid}, {high}, {low}, then a hit on {mid}")
    evicted = _allocate(pool, "allocate with three cached blocks")
    if evicted != high:
        why = {
            mid: f": block {mid} was hit (ref) and released again, which makes it the most recent",
            low: f" (block {low} has the lowest id, but it was released after {high})",
        }.get(evicted, "")
        raise CheckFailed(f"blocks released in the order {mid}, {high}, {low}, then {mid} hit and released again: "
                          f"the least recently used is {high}, you evicted {evicted}{why}. {LRU_HINT}")  # fmt: skip


def _live(cls: type, model: str) -> str:
    from minillm.course.checks.engines import (
        PROMPTS,
        SYSTEM,
        assert_pool_clean,
        compare_request_tokens,
        contiguous_reference,
        paged_engine,
        pool_bytes,
        run_all,
    )

    prompts = [SYSTEM + p for p in PROMPTS] * 2
    args = dict(block_size=4, kv_cache_memory=pool_bytes(model, 40, 4), enable_prefix_caching=True)
    package = paged_engine(model, **args)
    run_all(package, prompts)
    with hooks.override(block_pool=lambda num_blocks: GradedPool(cls, num_blocks)):
        engine = paged_engine(model, **args)
    if not isinstance(engine.block_manager.pool, GradedPool):
        raise CheckError("the engine was not built on the learner's class")
    outputs = run_all(engine, prompts)
    assert_pool_clean(engine)
    compare_request_tokens(outputs, contiguous_reference(model, tuple(prompts)), "the engine on your BlockPool",
                      "the diagnosis passed: what differs when many requests share and evict blocks?")  # fmt: skip
    hits, expected = engine.block_manager.prefix_hits, package.block_manager.prefix_hits
    if hits != expected:
        raise CheckFailed(f"the engine on your BlockPool found {hits} prompt tokens in the prefix cache, the package's "
                          f"pool {expected}: the same requests in the same pool must hit the same blocks")  # fmt: skip
    preemptions = sum(o.num_preemptions for o in outputs.values())
    return (
        f"{len(prompts)} requests in a 40-block pool ({preemptions} preemptions, {hits} prompt tokens from the cache)"
    )


@check
def check_block_pool(BlockPool, model: str = DEFAULT_MODEL) -> str:
    """``BlockPool(num_blocks)``: allocate, ref, release, register, lookup, forget."""
    cls = _class_of(BlockPool)
    _hand_out(cls)
    _names(cls)
    _eviction(cls)
    live = _live(cls, model)
    return (
        "your pool hands out, shares and frees blocks, names and finds them (no collision taken for a hit), keeps "
        f"cached blocks and evicts the least recently used; the engine on it ran {live}: tokens and prefix hits "
        "identical, no leak"
    )
