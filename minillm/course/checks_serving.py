"""Checks for chapters 03 (paged KV cache) and 04 (batching).

Each plugs the learner's function into the paged engine — the slot mapping into the model
runner, the hash and the block allocator into the block manager, the scheduling step into the
scheduler — runs real requests through it (under memory pressure, with shared prefixes,
with requests arriving mid-run) and compares every request's tokens with the contiguous-cache
engine of chapter 02.
"""

from __future__ import annotations

import functools

import torch

import minillm.hooks as hooks
from minillm.course.checks import DEFAULT_MODEL
from minillm.course.compare import compare_tensors, int_cases
from minillm.course.results import CheckError, CheckFailed, check, learner_cause
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


def _run_scattered(model: str, hook: dict, what: str, hint: str) -> None:
    """Every prompt through a paged engine whose free list is scattered (a sequence's blocks
    are not adjacent in the pool), with ``hook`` = {hook name: the learner's function} in
    place; each request must match the contiguous cache."""
    engine = _paged_engine(model, block_size=4)
    engine.block_manager.free_ids.rotate(7)
    with hooks.override(**hook):
        outputs = _run_all(engine, PROMPTS)
    _compare_requests(outputs, _reference(model, tuple(PROMPTS)), what, hint)


def _check_pool(engine) -> None:
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
    _run_scattered(
        model,
        {"slot_mapping": slot_mapping},
        "the engine writing K/V through your slot mapping",
        "check positions that cross a block boundary",
    )
    return f"the paged engine wrote every K/V through your slot mapping: {len(PROMPTS)} requests match the contiguous cache"


@check
def check_gather_kv(gather_kv, model: str = DEFAULT_MODEL) -> str:
    """``gather_kv(slots[num_slots, KV, D], block_tables[B, n], block_size) -> [B, KV, n*block_size, D]``."""
    gen = torch.Generator().manual_seed(3)
    block_size, kv, d = 4, 2, 3
    slots = torch.randn(10 * block_size, kv, d, generator=gen)
    tables = torch.tensor([[7, 2, 9], [0, 5, 5]])
    expected = slots.view(10, block_size, kv, d)[tables].reshape(2, 3 * block_size, kv, d).transpose(1, 2)
    got = gather_kv(slots, tables, block_size)
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
    if isinstance(got, torch.Tensor) and got.shape == expected.shape:
        in_order = slots.view(10, block_size, kv, d)[tables.sort(dim=1).values]
        if not torch.equal(tables.sort(dim=1).values, tables) and torch.equal(
            got, in_order.reshape(2, 3 * block_size, kv, d).transpose(1, 2)
        ):
            raise CheckFailed(
                "gather_kv read the blocks in id order, not in block-table order: position p is in table[p // block_size]"
            )
    compare_tensors(got, expected, "gather_kv(slots, [[7, 2, 9], [0, 5, 5]], block_size=4)")

    def engine_gather(pool, layer, block_tables, by_slot=False):  # hook gather_kv's signature
        return (
            gather_kv(pool.k_slots[layer], block_tables, pool.block_size),
            gather_kv(pool.v_slots[layer], block_tables, pool.block_size),
        )

    _run_scattered(
        model,
        {"gather_kv": engine_gather},
        "the paged engine reading K/V through your gather",
        "block j of a row is block_tables[row, j]; keep the table's order",
    )
    return (
        f"every attention layer of the paged engine read its K/V through your gather: {len(PROMPTS)} requests "
        "with scattered blocks match the contiguous cache"
    )


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
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    if block_hash(block_hash(None, first), second) == block_hash(block_hash(None, second), first):
        raise CheckFailed(
            "two blocks in swapped order got the same chained hash (as XOR-ing the parent with the block's "
            "hash does): hash the parent together with the tokens, so the chain depends on block order"
        )
    code = getattr(getattr(block_hash, "__wrapped__", block_hash), "__code__", None)
    if code is not None and "hash" in code.co_names and "hashlib" not in code.co_names:
        raise CheckFailed(
            "block_hash uses Python's built-in hash(): it is not stable across processes (hash(None) and "
            "str hashes change per process before Python 3.12), so two workers would name the same prefix "
            "differently. Use a real hash function over bytes (hashlib) and return an int"
        )
    if block_hash(a, [5, 6, 7, 8]) == block_hash(None, [5, 6, 7, 8]) or block_hash(a, [5, 6, 7, 8]) == block_hash(
        block_hash(None, [0, 0, 0, 0]), [5, 6, 7, 8]
    ):
        raise CheckFailed(
            "the same tokens after different prefixes got the same hash: include parent_hash in what you hash, "
            "so a block's name stands for its whole prefix (its K/V depend on everything before it)"
        )
    prompts = [SYSTEM + p for p in PROMPTS[:3]]
    engine = _paged_engine(model, block_size=8)
    with hooks.override(block_hash=block_hash):
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
    except Exception as err:
        raised = learner_cause(err) or err
        if not isinstance(raised, RuntimeError):
            raise CheckFailed(
                f"releasing block {taken[0]} twice raised {type(raised).__name__}: {raised}; a double free must "
                "raise RuntimeError"
            ) from None
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
            "with the free list empty, evict a cached block: pop it from bm.evictable, delete its hash from "
            "bm.cached and clear block.hash"
        )
    # Several cached blocks: the least recently used goes first (evictable is ordered oldest first).
    bm = BlockManager(num_blocks=4, block_size=2)
    ids = [take_free_block(bm) for _ in range(4)]
    for n, b in enumerate(ids[:3]):
        bm.blocks[b].hash = 100 + n
        bm.cached[100 + n] = b
    for b in ids[:3]:
        release_block(bm, b)  # released oldest first: ids[0] is the least recently used
    evicted = take_free_block(bm)
    if evicted != ids[0]:
        newest = " (popitem() takes the newest; use popitem(last=False))" if evicted == ids[2] else ""
        raise CheckFailed(
            f"three cached blocks were released in the order {ids[:3]}; with the free list empty you evicted "
            f"block {evicted}, not the least recently used {ids[0]}{newest}"
        )
    # The real engine on the learner's allocator: shared prefixes and a pool small enough to preempt.
    prompts = [SYSTEM + p for p in PROMPTS]
    engine = _paged_engine(model, block_size=4, kv_cache_memory=_pool_bytes(model, 40, 4))
    with hooks.override(take_free_block=take_free_block, release_block=release_block):
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


def _run_arriving(engine, prompts, priorities=None, on_step=None, max_steps: int = 3000) -> dict:
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
    ]
    int_cases(chunk_tokens, "chunk_tokens", cases, ("remaining", "budget", "chunked_prefill", "step_is_empty"))

    def tokens_to_run(scheduler, seq, budget, out):  # hook tokens_to_run's signature
        return chunk_tokens(
            len(seq) - seq.num_computed_tokens, budget, scheduler.enable_chunked_prefill, not out.chunks
        )

    steps = []
    for chunked in (True, False):
        engine = _paged_engine(model, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=chunked)
        with hooks.override(tokens_to_run=tokens_to_run):
            outputs = _run_arriving(engine, PROMPTS)
        _compare_requests(
            outputs,
            _reference(model, tuple(PROMPTS)),
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
        got = choose_victim(seq, list(candidates))
        if got is not expected:
            raise CheckFailed(f"choose_victim({seq}, {candidates}) returned {got!r}, expected {expected}: {why}")
    engine = _paged_engine(
        model, block_size=4, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory=_pool_bytes(model, 24, 4)
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
        outputs = _run_arriving(engine, PROMPTS, priorities)
    _compare_requests(
        outputs,
        _reference(model, tuple(PROMPTS)),
        "requests preempted by your choice",
        "a preempted request recomputes its tokens later; the choice only decides who waits",
    )
    _check_pool(engine)
    if not victims:
        raise CheckError("the workload was meant to run out of blocks, but nothing was preempted")
    return (
        f"a 24-block pool ran out {len(victims)} times; your choice preempted requests of priority "
        f"{sorted(set(victims))} and every request still matches running alone"
    )


@check
def check_continuous_schedule(schedule_continuous, model: str = DEFAULT_MODEL) -> str:
    """``schedule_continuous(scheduler) -> SchedulerOutput``: one continuous-batching step."""
    from minillm.sequence import SequenceStatus

    budget = 16
    engine = _paged_engine(
        model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4, kv_cache_memory=_pool_bytes(model, 24, 4)
    )
    steps = []

    def schedule(self, now):  # hook schedule's signature: (scheduler, now)
        waiting = self.waiting_in_order()
        decodes = [q for q in self.running if q.is_decoding]
        out = schedule_continuous(self)
        if out is None:
            raise CheckFailed("schedule_continuous returned None: return the SchedulerOutput you filled")
        if out.num_tokens > self.max_num_batched_tokens:
            raise CheckFailed(
                f"a step scheduled {out.num_tokens} tokens, over the budget of {self.max_num_batched_tokens}"
            )
        if len(self.running) > self.max_num_seqs:
            raise CheckFailed(f"{len(self.running)} sequences running, more than max_num_seqs={self.max_num_seqs}")
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
        admitting.append(seq)
        try:
            n = original_admit(self, seq, budget_left, out)
        finally:
            admitting.pop()
        if n == 0:
            refused.append(seq)
        return n

    def schedule_step(self, now):
        refused.clear()
        return schedule(self, now)

    with hooks.override(schedule=schedule_step, reserve=reserve, try_admit=try_admit, tokens_to_run=tokens_to_run):
        done = _run_arriving(engine, PROMPTS)
    joined = [out for out in steps if out.admitted and any(c.seq not in out.admitted for c in out.chunks)]
    if not joined:
        raise CheckFailed(
            "no request ever joined while others were running: that is static batching. Admit waiting "
            "sequences in the same step as the running ones, while seats, budget and blocks last"
        )
    _compare_requests(
        done,
        _reference(model, tuple(PROMPTS)),
        "requests under your scheduler",
        "schedule decodes first, then admit in FCFS order",
    )
    _check_pool(engine)
    preemptions = sum(o.num_preemptions for o in done.values())
    if not preemptions:
        raise CheckError("the workload was meant to run out of blocks, but nothing was preempted")
    return (
        f"{len(PROMPTS)} requests arriving mid-run all finished under your scheduler, {len(joined)} steps admitted "
        f"newcomers next to running decodes, {preemptions} preemptions in a 24-block pool; tokens identical to "
        "running each alone"
    )
