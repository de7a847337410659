"""Chapter 04's blocks of a step (``check_reserve_admit``): two right answers written independently,
and the wrong ones a learner writes, one slip each (``reserve_with`` / ``admit_with``)."""

from __future__ import annotations

from check_catalogue import right, wrong

from minillm.engine.scheduler import ScheduledChunk

RA = "check_reserve_admit"


def reserve_with(**slip):
    """The loop-until-it-fits reserve, with one learner's slip switched on."""

    def reserve(scheduler, seq, n, out, drafts=()):
        if slip.get("chunk_first"):
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n + len(drafts), list(drafts)))
        total = n if slip.get("drafts_uncounted") else n + len(drafts)
        copies = scheduler.block_manager.allocate_slots(seq, total)
        while copies is None:
            scheduled = [] if slip.get("scheduled_candidates") else [c.seq for c in out.chunks]
            candidates = [s for s in scheduler.running if s is not seq and s not in scheduled]
            if slip.get("no_choice"):
                victim = candidates[-1] if candidates else seq
            else:
                victim = scheduler.choose_victim(seq, candidates)
            if not slip.get("no_preempt"):
                scheduler.preempt(victim, out)
            if victim is seq:
                return True if slip.get("true_when_yielded") else False
            copies = scheduler.block_manager.allocate_slots(seq, total)
        if not slip.get("chunk_first"):
            start = 0 if slip.get("start_zero") else seq.num_computed_tokens
            kept = [] if slip.get("drafts_dropped") else list(drafts)
            out.chunks.append(ScheduledChunk(seq, start, total, kept))
        out.copies.extend(copies)
        return None if slip.get("returns_none") else True

    return reserve


def admit_with(**slip):
    """The match-allocate-or-undo try_admit, with one learner's slip switched on."""

    def try_admit(scheduler, seq, budget, out):
        blocks = scheduler.block_manager
        if not slip.get("no_prefix"):
            blocks.match_prefix(seq)
        if slip.get("ignores_budget"):
            n = len(seq) - seq.num_computed_tokens
        else:
            n = scheduler.tokens_to_run(seq, budget, out)
        if slip.get("early_remove"):
            scheduler.waiting.remove(seq)
        copies = blocks.allocate_slots(seq, n) if (n or slip.get("allocates_zero")) else None
        if copies is None:
            if not slip.get("no_cancel"):
                blocks.cancel_prefix(seq)
            return 0
        if not slip.get("early_remove"):
            scheduler.waiting.remove(seq)
        if not slip.get("no_start"):
            scheduler.start(seq, out)
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
        if not slip.get("no_copies"):
            out.copies.extend(copies)
        return budget if slip.get("returns_budget") else n

    return try_admit


GOOD_RESERVE, GOOD_ADMIT = reserve_with(), admit_with()

wrong(RA, "reserve returned True though seq itself was preempted", reserve_with(true_when_yielded=True), GOOD_ADMIT)
wrong(RA, "was preempted though its tokens were already scheduled", reserve_with(scheduled_candidates=True),
      GOOD_ADMIT)  # fmt: skip
wrong(RA, "preempt scheduler.choose_victim(seq, candidates)", reserve_with(no_choice=True), GOOD_ADMIT)
wrong(RA, "the chunk starts at seq.num_computed_tokens", reserve_with(start_zero=True), GOOD_ADMIT)
wrong(RA, "counts n + len(drafts) tokens", reserve_with(drafts_uncounted=True), GOOD_ADMIT)
wrong(RA, "with the drafts", reserve_with(drafts_dropped=True), GOOD_ADMIT)
wrong(RA, "though nothing could be scheduled", reserve_with(chunk_first=True), GOOD_ADMIT)
wrong(RA, "reserve returned None", reserve_with(returns_none=True), GOOD_ADMIT)
wrong(RA, "asked allocate_slots for room 50 times in one call", reserve_with(no_preempt=True), GOOD_ADMIT)
wrong(RA, "call match_prefix first", GOOD_RESERVE, admit_with(no_prefix=True))
wrong(RA, "put back with cancel_prefix(seq)", GOOD_RESERVE, admit_with(no_cancel=True))
wrong(RA, "only once the blocks are allocated, take seq off scheduler.waiting", GOOD_RESERVE,
      admit_with(early_remove=True))  # fmt: skip
wrong(RA, "call scheduler.start(seq, out)", GOOD_RESERVE, admit_with(no_start=True))
wrong(RA, "try_admit returned 16, expected 10", GOOD_RESERVE, admit_with(returns_budget=True))
wrong(RA, "try_admit returned 10, expected 4", GOOD_RESERVE, admit_with(ignores_budget=True))
wrong(RA, "extend out.copies with what allocate_slots returned", GOOD_RESERVE, admit_with(no_copies=True))
wrong(RA, "when tokens_to_run gives 0, allocate nothing", GOOD_RESERVE, admit_with(allocates_zero=True))


def reserve_by_room(scheduler, seq, n, out, drafts=()):
    """Right, written differently: ask can_allocate first, preempt the chosen victim until there is room."""
    blocks = scheduler.block_manager
    need = n + len(drafts)
    while not blocks.can_allocate(seq, need):
        busy = {id(chunk.seq) for chunk in out.chunks}
        others = [r for r in scheduler.running if r is not seq and id(r) not in busy]
        loser = scheduler.choose_victim(seq, others)
        scheduler.preempt(loser, out)
        if loser is seq:
            return False
    copies = blocks.allocate_slots(seq, need)
    out.copies += copies
    out.chunks.append(ScheduledChunk(seq=seq, start=seq.num_computed_tokens, num_tokens=need, draft_tokens=[*drafts]))
    return True


def admit_or_undo(scheduler, seq, budget, out):
    """Right, written differently: one exit for every failure, the queue touched last."""
    blocks = scheduler.block_manager
    blocks.match_prefix(seq)
    n = scheduler.tokens_to_run(seq, budget, out)
    copies = None
    if n > 0:
        copies = blocks.allocate_slots(seq, n)
    if copies is None:
        blocks.cancel_prefix(seq)
        return 0
    out.copies += copies
    out.chunks.append(ScheduledChunk(seq=seq, start=seq.num_computed_tokens, num_tokens=n))
    scheduler.waiting.remove(seq)
    scheduler.start(seq, out)
    return n


right(RA, GOOD_RESERVE, GOOD_ADMIT)
right(RA, reserve_by_room, admit_or_undo)
