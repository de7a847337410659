"""Checks for chapters 03 (paged KV cache) and 04 (batching).

Each plugs the learner's function into the paged engine — the slot mapping into the model
runner, the hash and the block allocator into the block manager, the scheduling step into the
scheduler — runs real requests through it (under memory pressure, with shared prefixes,
with requests arriving mid-run) and compares every request's tokens with the contiguous-cache
engine of chapter 02.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from minillm.course.checks import DEFAULT_MODEL
from minillm.course.results import CheckFailed, check
from minillm.kvcache import block_manager as bm_module
from minillm.kvcache.block_manager import BlockManager

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
def _reference(model: str, prompts: tuple[str, ...]) -> list[list[int]]:
    """Each prompt alone through the contiguous-cache engine (chapter 02's rung)."""
    from minillm import LLM

    llm = LLM(model, dtype="fp32", mode="contiguous", attention_backend="torch")
    return [llm.generate(p, _params())[0].token_ids for p in prompts]


def _paged_engine(model: str, **kwargs):
    from minillm import LLMEngine

    return LLMEngine(model, dtype="fp32", attention_backend="torch", **kwargs)


def _pool_bytes(engine_model: str, blocks: int, block_size: int) -> int:
    from minillm.assets import resolve_model
    from minillm.config import ModelConfig
    from minillm.kvcache.addressing import kv_bytes_per_token

    config = ModelConfig.from_folder(resolve_model(engine_model))
    return blocks * block_size * kv_bytes_per_token(config, torch.float32)


def _run_all(engine, prompts, max_steps: int = 2000) -> dict:
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


def _compare_requests(outputs: dict, expected: list[list[int]], what: str, hint: str) -> None:
    for n, (out, ref) in enumerate(zip(outputs.values(), expected)):
        got = out.token_ids
        if got != ref:
            i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            raise CheckFailed(
                f"{what}: request {n} ({PROMPTS[n % len(PROMPTS)][:20]!r}...) differs from the reference at "
                f"token {i} (got {got[i : i + 3]}, expected {ref[i : i + 3]}). Hint: {hint}"
            )


def _check_pool(engine) -> None:
    try:
        engine.block_manager.check_invariants()
    except AssertionError as err:
        raise CheckFailed(f"the block manager's bookkeeping is broken: {err}") from None
    if engine.block_manager.num_used_blocks:
        raise CheckFailed(
            f"{engine.block_manager.num_used_blocks} blocks are still referenced after every request finished: a leak"
        )


@contextlib.contextmanager
def _patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


# ---------------------------------------------------------------------------------------------
# Chapter 03: the paged KV cache
# ---------------------------------------------------------------------------------------------


@check
def check_slot_mapping(slot_mapping, model: str = DEFAULT_MODEL) -> str:
    """``slot_mapping(block_table, start, num_tokens, block_size) -> list[int]``: pool slots of positions."""
    got = slot_mapping([7, 2, 9], 3, 4, 4)  # positions 3, 4, 5, 6 in blocks of 4
    expected = [31, 8, 9, 10]
    if got == [3, 4, 5, 6]:
        raise CheckFailed(
            "slot_mapping returned the positions themselves: position p lives in block "
            "block_table[p // block_size], so its slot is block_table[p // block_size] * block_size + p % block_size"
        )
    if got == [3, 0, 1, 2]:
        raise CheckFailed("slot_mapping returned offsets inside blocks; add block_table[p // block_size] * block_size")
    if not isinstance(got, list) or got != expected:
        raise CheckFailed(
            f"slot_mapping([7, 2, 9], start=3, num_tokens=4, block_size=4) returned {got!r}, expected {expected} "
            "(position 3 is the last slot of block 7, positions 4-6 the first slots of block 2)"
        )
    from minillm.kvcache import addressing

    engine = _paged_engine(model, block_size=4)
    # Scatter the free list so a sequence's blocks are not contiguous in the pool.
    engine.block_manager.free_ids.rotate(7)
    with _patched(addressing, "slot_mapping", slot_mapping):
        outputs = _run_all(engine, PROMPTS)
    _compare_requests(
        outputs,
        _reference(model, tuple(PROMPTS)),
        "the engine writing K/V through your slot mapping",
        "check positions that cross a block boundary",
    )
    return f"the paged engine wrote every K/V through your slot mapping: {len(PROMPTS)} requests match the contiguous cache"


@check
def check_block_hash(block_hash, model: str = DEFAULT_MODEL) -> str:
    """``block_hash(parent_hash, token_ids) -> int``: a full block's name, chained to its prefix."""
    a = block_hash(None, [1, 2, 3, 4])
    if not isinstance(a, int) or isinstance(a, bool):
        raise CheckFailed(f"block_hash should return an int, got {type(a).__name__}")
    if block_hash(None, [1, 2, 3, 4]) != a or block_hash(None, (1, 2, 3, 4)) != a:
        raise CheckFailed("block_hash gave different results for the same tokens: hash a tuple of them")
    if block_hash(None, [4, 3, 2, 1]) == a:
        raise CheckFailed("block_hash ignores the order of the tokens")
    if block_hash(a, [5, 6, 7, 8]) == block_hash(None, [5, 6, 7, 8]) or block_hash(a, [5, 6, 7, 8]) == block_hash(
        block_hash(None, [0, 0, 0, 0]), [5, 6, 7, 8]
    ):
        raise CheckFailed(
            "the same tokens after different prefixes got the same hash: include parent_hash in what you hash, "
            "so a block's name stands for its whole prefix (its K/V depend on everything before it)"
        )
    prompts = [SYSTEM + p for p in PROMPTS[:3]]
    engine = _paged_engine(model, block_size=8)
    with _patched(bm_module, "block_hash", block_hash):
        first = _run_all(engine, prompts[:1])
        rest = _run_all(engine, prompts[1:])
    _compare_requests(
        first | rest,
        _reference(model, tuple(prompts)),
        "requests with a cached prefix",
        "hash (parent_hash, tuple(token_ids))",
    )
    hits = [o.num_cached_tokens for o in rest.values()]
    if min(hits) == 0:
        raise CheckFailed("later requests sharing the system prompt found nothing in the prefix cache")
    _check_pool(engine)
    return (
        f"with your hash, requests sharing the {len(engine.tokenizer.encode(SYSTEM))}-token system prompt reused "
        f"{hits} of their prompt tokens from the cache, tokens identical to recomputing them"
    )


@check
def check_block_allocation(take_free_block, release_block, model: str = DEFAULT_MODEL) -> str:
    """``take_free_block(bm) -> block id`` and ``release_block(bm, block_id)``, the pool's allocator."""
    bm = BlockManager(num_blocks=3, block_size=2)
    taken = [take_free_block(bm) for _ in range(3)]
    if sorted(taken) != [0, 1, 2]:
        raise CheckFailed(f"three allocations from a pool of 3 returned {taken}; each block must be handed out once")
    if any(bm.blocks[b].ref_count != 1 for b in taken):
        raise CheckFailed("a newly taken block should have ref_count 1 (one owner)")
    if bm.free_ids:
        raise CheckFailed(
            "taken blocks are still on bm.free_ids: remove a block from the free list when you hand it out"
        )
    bm.blocks[taken[1]].ref_count = 2  # shared by two sequences
    release_block(bm, taken[1])
    if taken[1] in bm.free_ids:
        raise CheckFailed(
            "a block shared by two sequences went back on the free list after one release: decrement ref_count, free at 0"
        )
    release_block(bm, taken[1])
    release_block(bm, taken[0])
    if sorted(bm.free_ids) != sorted([taken[0], taken[1]]):
        raise CheckFailed(f"after releasing blocks {taken[0]} and {taken[1]} the free list is {list(bm.free_ids)}")
    try:
        release_block(bm, taken[0])
    except RuntimeError:
        pass
    else:
        raise CheckFailed(f"releasing block {taken[0]} twice did not raise: a double free must raise RuntimeError")
    # A cached (hashed) block is kept, unreferenced, and evicted only when the free list is empty.
    bm = BlockManager(num_blocks=2, block_size=2)
    first = take_free_block(bm)
    bm.blocks[first].hash = 1234
    bm.cached[1234] = first
    release_block(bm, first)
    if first in bm.free_ids or first not in bm.evictable:
        raise CheckFailed(
            "a released block with a prefix hash should go to bm.evictable (kept for the cache), not the free list"
        )
    second = take_free_block(bm)
    if second == first:
        raise CheckFailed(
            "a cached block was reused while the free list still had a block: evict only when it is empty"
        )
    third = take_free_block(bm)
    if third != first or 1234 in bm.cached or bm.blocks[first].hash is not None:
        raise CheckFailed(
            "with the free list empty, evict the least recently used cached block: pop it from bm.evictable, delete its hash from bm.cached and clear block.hash"
        )
    # The real engine on the learner's allocator: shared prefixes and a pool small enough to preempt.
    prompts = [SYSTEM + p for p in PROMPTS]
    engine = _paged_engine(model, block_size=4, kv_cache_memory=_pool_bytes(model, 40, 4))
    with _patched(BlockManager, "_take_free_block", take_free_block), _patched(BlockManager, "_unref", release_block):
        outputs = _run_all(engine, prompts)
        _check_pool(engine)
    _compare_requests(
        outputs,
        _reference(model, tuple(prompts)),
        "the engine on your allocator",
        "compare with the block manager's own methods",
    )
    preemptions = sum(o.num_preemptions for o in outputs.values())
    return (
        f"the engine ran {len(prompts)} requests on your allocator in a 40-block pool ({preemptions} preemptions, "
        "prefix blocks shared and evicted): no leak, no double free, tokens identical"
    )


# ---------------------------------------------------------------------------------------------
# Chapter 04: batching
# ---------------------------------------------------------------------------------------------


@check
def check_continuous_schedule(schedule_continuous, model: str = DEFAULT_MODEL) -> str:
    """``schedule_continuous(scheduler) -> SchedulerOutput``: one continuous-batching step."""
    from minillm.engine.scheduler import Scheduler

    budget = 16
    engine = _paged_engine(
        model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4, kv_cache_memory=_pool_bytes(model, 48, 4)
    )
    steps = []

    def schedule(self, now):
        self._now = now
        out = schedule_continuous(self)
        if out is None:
            raise CheckFailed("schedule_continuous returned None: return the SchedulerOutput you filled")
        if out.num_tokens > self.max_num_batched_tokens:
            raise CheckFailed(
                f"a step scheduled {out.num_tokens} tokens, over the budget of {self.max_num_batched_tokens}"
            )
        if len(self.running) > self.max_num_seqs:
            raise CheckFailed(f"{len(self.running)} sequences running, more than max_num_seqs={self.max_num_seqs}")
        steps.append(out)
        return out

    # Requests arrive while others run: two now, the rest one per step.
    with _patched(Scheduler, "schedule", schedule):
        ids = [engine.add_request(p, _params()) for p in PROMPTS[:2]]
        done = {}
        pending = list(PROMPTS[2:])
        for _ in range(3000):
            if not engine.has_unfinished_requests() and not pending:
                break
            if pending:
                ids.append(engine.add_request(pending.pop(0), _params()))
            for d in engine.step():
                if d.output is not None:
                    done[d.request_id] = d.output
        else:
            raise CheckFailed(
                f"after 3000 steps requests {[i for i in ids if i not in done]} were unfinished: every step must "
                "schedule the running sequences (decodes) before admitting new ones"
            )
    joined = [out for out in steps if out.admitted and any(c.seq not in out.admitted for c in out.chunks)]
    if not joined:
        raise CheckFailed(
            "no request ever joined while others were running: that is static batching. Admit waiting "
            "sequences in the same step as the running ones, while seats, budget and blocks last"
        )
    _compare_requests(
        {i: done[i] for i in ids},
        _reference(model, tuple(PROMPTS)),
        "requests under your scheduler",
        "schedule decodes first, then admit in FCFS order",
    )
    _check_pool(engine)
    preemptions = sum(o.num_preemptions for o in done.values())
    return (
        f"{len(PROMPTS)} requests arriving mid-run all finished under your scheduler, {len(joined)} steps admitted "
        f"newcomers next to running decodes, {preemptions} preemptions; tokens identical to running each alone"
    )
