"""Chapter 04's blocks-for-the-step exercise: ``reserve`` (a running sequence's tokens, preempting
while the pool is full) and ``try_admit`` (a waiting sequence's first chunk, or nothing at all).

The diagnosis runs hand-made scenes twice, on two engines built and driven alike: once with the
learner's function, once with the package's. Everything a call may change is then compared —
what it returned, the step's chunks, copies, preempted and admitted lists, the waiting and
running queues, each sequence's status and computed tokens, and the block manager's tables,
reference counts and free blocks — and the first difference is named with what causes it. The
plug-in run then serves requests arriving mid-run through a 24-block pool with a shared system
prompt (preemptions and prefix hits) with both functions in the scheduler: every request's tokens
must match the contiguous cache, and no block may be left behind.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.checks.engines import (
    PROMPTS,
    SYSTEM,
    assert_pool_clean,
    compare_request_tokens,
    contiguous_reference,
    paged_engine,
    pool_bytes,
    run_arriving,
)
from minillm.course.results import CheckFailed, check

BLOCK = 4


def _engine(model: str, blocks: int, caching: bool = False):
    return paged_engine(model, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4,
                        kv_cache_memory=pool_bytes(model, blocks, BLOCK), enable_prefix_caching=caching)  # fmt: skip


def _add(engine, tokens: list[int], priority: int = 0, max_tokens: int = 12):
    from minillm import SamplingParams

    rid = engine.add_request(list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority)
    return next(s for s in engine.scheduler.waiting if s.request_id == rid)


def _seq(s, request_id):
    """The sequence ``request_id`` of scheduler ``s`` (each run of a scene gets its own copy of the state)."""
    return next(q for q in [*s.running, *s.waiting] if q.request_id == request_id)


@dataclass
class Scene:
    """A hand-made scheduler state and the one call the learner's function answers in it."""

    what: str  # the state, in words, for the message
    function: str  # "reserve" or "try_admit"
    build: Callable  # (model) -> (engine, call(fn, scheduler, out) -> result)


def _two_decoding(model: str, a_priority: int, b_priority: int):
    """A (8-token prompt) and B (7) decoding in a 4-block pool that they fill: A's next token needs a new block."""
    engine = _engine(model, 4)
    a = _add(engine, range(5, 13), a_priority, max_tokens=4)
    _add(engine, range(20, 27), b_priority, max_tokens=4)
    engine.step()
    return engine, a.request_id


def _scene_room(model):
    engine = _engine(model, 16)
    a = _add(engine, range(5, 12))
    engine.step()
    return engine, lambda fn, s, out: fn(s, _seq(s, a.request_id), 1, out)


def _scene_drafts(model):
    engine = _engine(model, 16)
    a = _add(engine, range(5, 12))
    engine.step()
    return engine, lambda fn, s, out: fn(s, _seq(s, a.request_id), 1, out, [40, 41, 42])


def _scene_forked(model):
    from minillm import SamplingParams

    engine = _engine(model, 16)
    params = SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1, ignore_eos=True)
    rid = engine.add_request(list(range(5, 12)), params)
    engine.step()  # prefilled once, then forked: both samples share the prompt's blocks
    return engine, lambda fn, s, out: fn(s, _seq(s, rid), 1, out)


def _scene_preempt_other(model):
    engine, a = _two_decoding(model, 0, 1)
    return engine, lambda fn, s, out: fn(s, _seq(s, a), 1, out)


def _scene_yields(model):
    engine, a = _two_decoding(model, 1, 0)
    return engine, lambda fn, s, out: fn(s, _seq(s, a), 1, out)


def _scene_scheduled_not_candidates(model):
    engine, a = _two_decoding(model, 0, 1)
    b = next(q.request_id for q in engine.scheduler.running if q.request_id != a)

    def call(fn, s, out):
        hooks.default("reserve")(s, _seq(s, b), 1, out)  # B's token is in the step already (its block has room)
        return fn(s, _seq(s, a), 1, out)

    return engine, call


def _scene_admit(budget: int):
    def build(model):
        engine = _engine(model, 16)
        _add(engine, range(5, 12))
        engine.step()
        c = _add(engine, range(30, 40))
        return engine, lambda fn, s, out: fn(s, _seq(s, c.request_id), budget, out)

    return build


def _scene_admit_prefix(model):
    engine = _engine(model, 16, caching=True)
    _add(engine, range(50, 62), max_tokens=1)
    while engine.has_unfinished_requests():
        engine.step()
    c = _add(engine, [*range(50, 58), 90, 91, 92])  # its first 2 blocks are cached
    return engine, lambda fn, s, out: fn(s, _seq(s, c.request_id), 16, out)


def _scene_admit_shared(model):
    engine = _engine(model, 16, caching=True)
    _add(engine, range(50, 62))
    engine.step()  # request 0 prefilled: its 3 full blocks are named in the prefix cache
    c = _add(engine, range(50, 62))  # the same prompt: all cached, its last token recomputed into a copy
    return engine, lambda fn, s, out: fn(s, _seq(s, c.request_id), 16, out)


def _scene_admit_no_room(model):
    engine = _engine(model, 5, caching=True)
    _add(engine, range(50, 58), max_tokens=1)  # two full blocks, cached when it finishes
    while engine.has_unfinished_requests():
        engine.step()
    _add(engine, range(5, 17), max_tokens=8)  # 3 blocks, then a 4th as it decodes
    engine.step()
    c = _add(engine, [*range(50, 58), *range(70, 78)], max_tokens=4)  # its prefix is cached; the rest does not fit
    return engine, lambda fn, s, out: fn(s, _seq(s, c.request_id), 16, out)


def _scene_admit_no_budget(model):
    engine = paged_engine(model, block_size=BLOCK, max_num_batched_tokens=16, enable_chunked_prefill=False,
                          enable_prefix_caching=False, kv_cache_memory=pool_bytes(model, 16, BLOCK))  # fmt: skip
    a = _add(engine, range(5, 12))
    engine.step()
    c = _add(engine, range(30, 40))

    def call(fn, s, out):
        hooks.default("reserve")(s, _seq(s, a.request_id), 1, out)  # the step is not empty
        return fn(s, _seq(s, c.request_id), 4, out)  # a 10-token prompt, whole or not at all

    return engine, call


SCENES = [
    Scene("request 0 decodes, and its block has room", "reserve", _scene_room),
    Scene("request 0 decodes with 3 speculative proposals (drafts=[40, 41, 42])", "reserve", _scene_drafts),
    Scene(
        "request 0 has two samples (n=2) sharing the prompt's blocks, and sample 0 writes into the shared last "
        "block (copy-on-write)",
        "reserve",
        _scene_forked,
    ),
    Scene(
        "the 4-block pool is full; request 0 (priority 0) needs a new block, request 1 (priority 1) is not "
        "scheduled yet",
        "reserve",
        _scene_preempt_other,
    ),  # fmt: skip
    Scene(
        "the 4-block pool is full; request 0 (priority 1) needs a new block, request 1 (priority 0) outranks it",
        "reserve",
        _scene_yields,
    ),  # fmt: skip
    Scene(
        "the 4-block pool is full; request 1 is already scheduled this step, request 0 needs a new block",
        "reserve",
        _scene_scheduled_not_candidates,
    ),  # fmt: skip
    Scene("request 1 (a 10-token prompt) waits, a 16-block pool has room, budget 16", "try_admit", _scene_admit(16)),
    Scene("request 1 (a 10-token prompt) waits, budget 4 (chunked prefill)", "try_admit", _scene_admit(4)),
    Scene("request 1's first 8 tokens are cached blocks of a finished request", "try_admit", _scene_admit_prefix),
    Scene(
        "request 1's whole 12-token prompt is cached, in blocks running request 0 shares (copy-on-write)",
        "try_admit",
        _scene_admit_shared,
    ),
    Scene(
        "request 2's first 8 tokens are cached, but its other 8 do not fit the pool", "try_admit", _scene_admit_no_room
    ),  # fmt: skip
    Scene(
        "no chunked prefill: request 1's 10-token prompt meets a budget of 4 in a step that is not empty",
        "try_admit",
        _scene_admit_no_budget,
    ),  # fmt: skip
]


MAX_ALLOCATIONS = 50  # allocate_slots calls in one scene's call: no scene needs more than a few


class _GuardedBlocks:
    """A scene's block manager as the learner's call sees it: itself, but a loop that asks for room
    without ever freeing any (no preemption) fails the check instead of spinning for ever."""

    def __init__(self, blocks, function: str):
        self.blocks, self.function, self.calls = blocks, function, 0

    def allocate_slots(self, seq, num_new_tokens):
        self.calls += 1
        if self.calls > MAX_ALLOCATIONS:
            raise CheckFailed(
                f"{self.function} asked allocate_slots for room {MAX_ALLOCATIONS} times in one call: when it returns "
                "None, preempt the chosen victim with scheduler.preempt(victim, out) (that frees its blocks), and "
                "return False when the victim is seq"
            )
        return self.blocks.allocate_slots(seq, num_new_tokens)

    def __getattr__(self, name):
        return getattr(self.blocks, name)


class _Guarded:
    """A scene's scheduler as the learner's call sees it: itself, with the guarded block manager."""

    def __init__(self, scheduler, function: str):
        self.scheduler = scheduler
        self.block_manager = _GuardedBlocks(scheduler.block_manager, function)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


def _state(s, out, result) -> dict:
    """Everything a reserve or try_admit may change, by request id (comparable across copies)."""
    bm = s.block_manager
    seqs = sorted([*s.running, *s.waiting], key=lambda q: str(q.request_id))
    return {  # in the order differences are reported: a wrong preemption first, it explains the rest
        "preempted": [q.request_id for q in out.preempted],
        "returned": result,
        "chunks": [(c.seq.request_id, c.start, c.num_tokens, list(c.draft_tokens)) for c in out.chunks],
        "copies": list(out.copies),
        "admitted": [q.request_id for q in out.admitted],
        "waiting": sorted(str(q.request_id) for q in s.waiting),
        "running": sorted(str(q.request_id) for q in s.running),
        "status": {q.request_id: q.status.name for q in seqs},
        "computed": {q.request_id: q.num_computed_tokens for q in seqs},
        "tables": {rid: list(t) for rid, t in bm.tables.items()},
        "refs": [b.ref_count for b in bm.blocks],
        "free": bm.num_free_blocks,
    }


def _why(field: str, got, want, scene: Scene, chunks: list) -> str:
    """What a difference in ``field`` means (``chunks``: the step's chunks before the call), and where to look."""
    reserve = scene.function == "reserve"
    if field == "returned":
        if reserve and not isinstance(got, bool):
            return f"reserve returned {got!r}; return True when the tokens are scheduled, False when seq itself was preempted"
        if reserve:
            return (
                "reserve returned True though seq itself was preempted: return False when the victim is seq"
                if want is False
                else "reserve returned False, but seq's tokens were to be scheduled"
            )
        if not isinstance(got, int) or isinstance(got, bool):
            return f"try_admit returned {got!r}: return the number of tokens scheduled (an int; 0 when it could not)"
        return f"try_admit returned {got}, expected {want}: the tokens scheduled for seq (what tokens_to_run gave, 0 when it could not)"
    if field == "chunks":
        if not got and want:
            return f"nothing was scheduled; expected the chunk {want} (request, start, num_tokens, drafts): append a ScheduledChunk to out.chunks"
        empty = [c for c in got if c[2] == 0]
        if empty:
            return (
                f"request {empty[0][0]} got a chunk of 0 tokens: when tokens_to_run gives 0, allocate nothing, change "
                "nothing and return 0 (it waits for a later step)"
            )
        if got and not want:
            return f"the step got the chunk {got} though nothing could be scheduled: append the chunk only once the blocks are allocated"
        return (
            f"the step's chunks are {got}, expected {want} (request, start, num_tokens, drafts): the chunk starts at "
            "seq.num_computed_tokens (after match_prefix for a newcomer) and counts n + len(drafts) tokens, with the drafts"
        )
    if field == "copies":
        return f"out.copies is {got}, expected {want}: extend out.copies with what allocate_slots returned (copy-on-write before the step)"
    if field == "preempted":
        scheduled = [rid for rid in got if rid in {c[0] for c in chunks}]
        if scheduled:
            return (
                f"request {scheduled[0]} was preempted though its tokens were already scheduled this step (in "
                "out.chunks): the candidates are the running sequences that are neither seq nor scheduled"
            )
        if reserve and len(got) > len(want):
            return (
                f"requests {got} were preempted, expected {want}: preempt only while allocate_slots fails, choose the "
                "victim with scheduler.choose_victim among the running sequences that are neither seq nor scheduled "
                "this step (out.chunks)"
            )
        return (
            f"requests {got} were preempted, expected {want}: when allocate_slots returns None, preempt "
            "scheduler.choose_victim(seq, candidates) with scheduler.preempt(victim, out), then try again"
        )
    if field in ("admitted", "waiting", "running", "status"):
        if reserve:
            return f"{field} is {got}, expected {want}: reserve changes the queues only through scheduler.preempt"
        return (
            f"{field} is {got}, expected {want}: only once the blocks are allocated, take seq off scheduler.waiting "
            "and call scheduler.start(seq, out) (it runs from this step); when they are not, change nothing"
        )
    if field == "computed":
        return (
            f"the computed tokens are {got}, expected {want}: a newcomer starts with scheduler.block_manager."
            "match_prefix(seq) (its cached prefix is computed already), and one that does not fit is put back with "
            "cancel_prefix(seq)"
        )
    return f"the block manager's {field} are {got}, expected {want}: " + (
        "allocate with scheduler.block_manager.allocate_slots(seq, n + len(drafts)), once it succeeds"
        if reserve
        else "match_prefix first; allocate_slots(seq, n) only when tokens_to_run gave n > 0; when it returns None, "
        "cancel_prefix(seq) gives the cached blocks back"
    )


@functools.lru_cache(maxsize=len(SCENES))
def _built(i: int, model: str):
    """Scene ``i``'s scheduler, reached once per process (each run works on a deep copy: the
    scheduler, its block manager and the sequences are plain Python objects)."""
    engine, call = SCENES[i].build(model)
    return engine.scheduler, call


def _diagnose(reserve, try_admit, model: str = DEFAULT_MODEL) -> None:
    from minillm.engine.scheduler import SchedulerOutput

    learner = {"reserve": reserve, "try_admit": try_admit}
    for i, scene in enumerate(SCENES):
        scheduler, call = _built(i, model)
        states = []
        for fn in (learner[scene.function], hooks.default(scene.function)):
            s, out = copy.deepcopy(scheduler), SchedulerOutput()  # the same state for both
            result = call(fn, _Guarded(s, scene.function), out)
            states.append(_state(s, out, result))
        got, want = states
        for field in want:
            if got[field] != want[field]:
                why = _why(field, got[field], want[field], scene, want["chunks"])
                raise CheckFailed(f"{scene.function}, when {scene.what}: {why}")


@check
def check_reserve_admit(reserve, try_admit, model: str = DEFAULT_MODEL) -> str:
    """``reserve(scheduler, seq, n, out, drafts=()) -> bool`` and ``try_admit(scheduler, seq,
    budget, out) -> int``: the blocks of a scheduling step."""
    _diagnose(reserve, try_admit, model)
    prompts = [SYSTEM + p for p in PROMPTS]
    engine = paged_engine(model, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4,
                          kv_cache_memory=pool_bytes(model, 24, BLOCK))  # fmt: skip
    calls = {"reserve": 0, "try_admit": 0}

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)

        return run

    with hooks.override(reserve=counted("reserve", reserve), try_admit=counted("try_admit", try_admit)):
        done = run_arriving(engine, prompts)
    compare_request_tokens(
        done,
        contiguous_reference(model, tuple(prompts)),
        "requests scheduled with your reserve and try_admit",
        "every hand-made scene matched: look at what differs over many steps (a preempted sequence's blocks, "
        "a prefix that is matched twice)",
    )
    assert_pool_clean(engine)
    preemptions = sum(o.num_preemptions for o in done.values())
    hits = engine.block_manager.prefix_hits
    if not preemptions or not hits:
        raise RuntimeError(f"the workload was meant to preempt and hit the prefix cache ({preemptions}, {hits})")
    return (
        f"your reserve ({calls['reserve']} calls) and try_admit ({calls['try_admit']}) scheduled {len(prompts)} "
        f"requests arriving mid-run through a 24-block pool: {preemptions} preemptions, {hits} tokens from the prefix "
        "cache, tokens identical to the contiguous cache, no block left behind"
    )


def try_scenes(reserve, try_admit, model: str = DEFAULT_MODEL) -> None:
    """Run your functions on every hand-made scene of the check and print, for each, what yours
    did beside what the package's did (returned value, chunks, preempted, admitted). A quick look
    before the check; the check compares everything else too (queues, block tables, counts)."""
    from minillm.engine.scheduler import SchedulerOutput

    learner = {"reserve": reserve, "try_admit": try_admit}
    for i, scene in enumerate(SCENES):
        scheduler, call = _built(i, model)
        print(f"{scene.function}, when {scene.what}:")
        for who, fn in (("yours", learner[scene.function]), ("package", hooks.default(scene.function))):
            s, out = copy.deepcopy(scheduler), SchedulerOutput()
            try:
                state = _state(s, out, call(fn, _Guarded(s, scene.function), out))
            except NotImplementedError:
                print(f"  {who:>7}: not written yet")
                continue
            print(f"  {who:>7}: returned {state['returned']!r}, chunks {state['chunks']}, preempted "
                  f"{state['preempted']}, admitted {state['admitted']}")  # fmt: skip
