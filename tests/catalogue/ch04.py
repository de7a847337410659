"""Chapter 04, batching: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import itertools

import numpy as np

from catalogue.answers import Answers
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.sequence import SequenceStatus

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 04: batching ---------------------------------------------------------------------------


def chunk_tokens(remaining, budget, chunked_prefill, step_is_empty):
    if chunked_prefill:
        return min(remaining, budget)
    return remaining if remaining <= budget or step_is_empty else 0


def chunk_tokens_nested(remaining, budget, chunked_prefill, step_is_empty):
    fits = remaining <= budget
    if fits:
        return remaining
    if chunked_prefill:
        return budget
    if step_is_empty:
        return remaining  # a prompt longer than the whole budget runs alone
    return 0


right("check_chunk_tokens", chunk_tokens)
right("check_chunk_tokens", chunk_tokens_nested)
wrong("check_chunk_tokens", "waits for a later step", lambda r, b, c, e: min(r, b))
wrong("check_chunk_tokens", "runs alone in an empty step", lambda r, b, c, e: chunk_tokens(r, b, c, False))
wrong("check_chunk_tokens", "takes what is left of the budget", lambda r, b, c, e: r)
wrong("check_chunk_tokens", "a decode needs one token", lambda r, b, c, e: b if c else chunk_tokens(r, b, c, e))
wrong("check_chunk_tokens", "an exhausted budget runs nothing", lambda r, b, c, e: max(1, chunk_tokens(r, b, c, e)))
wrong(
    "check_chunk_tokens",
    "exactly the size of the budget",
    lambda r, b, c, e: min(r, b) if c else (r if r < b or e else 0),
)


def choose_victim(seq, candidates):
    victim = max(candidates, key=lambda s: s.sort_key, default=seq)
    return seq if victim.sort_key < seq.sort_key else victim


def choose_victim_sorted(seq, candidates):
    return sorted([seq, *candidates], key=lambda s: s.sort_key)[-1]


right("check_choose_victim", choose_victim)
right("check_choose_victim", choose_victim_sorted)
wrong("check_choose_victim", "latest arrival among equals", lambda seq, c: c[0] if c else seq)
wrong("check_choose_victim", "must not depend on the order", lambda seq, c: c[-1] if c else seq)
wrong("check_choose_victim", "latest arrival", lambda seq, c: min(c, key=lambda s: s.sort_key, default=seq))
wrong("check_choose_victim", "seq preempts itself", lambda seq, c: max(c, key=lambda s: s.sort_key, default=seq))
wrong("check_choose_victim", "latest arrival", lambda seq, c: seq)
wrong(
    "check_choose_victim",
    "a lower priority",
    lambda seq, c: max([seq, *c], key=lambda s: s.sort_key[1]),
)


def schedule_continuous(scheduler):
    out = SchedulerOutput()
    budget = scheduler.max_num_batched_tokens
    for seq in scheduler.running_in_order():
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING:
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and scheduler.reserve(seq, n, out):
            budget -= n
    if not out.preempted:
        for seq in scheduler.waiting_in_order():
            if len(scheduler.running) >= scheduler.max_num_seqs or budget == 0:
                break
            n = scheduler.try_admit(seq, budget, out)
            if n == 0:
                break
            budget -= n
    return out


def schedule_continuous_queue(scheduler):
    """Independent: counts what is used instead of what is left, walks the queue by index."""
    out = SchedulerOutput()
    used = 0
    for seq in [s for s in scheduler.running_in_order()]:
        if seq.status != SequenceStatus.RUNNING or used >= scheduler.max_num_batched_tokens:
            continue
        n = scheduler.tokens_to_run(seq, scheduler.max_num_batched_tokens - used, out)
        if n > 0 and scheduler.reserve(seq, n, out):
            used += n
    queue = scheduler.waiting_in_order()
    i = 0
    while not out.preempted and i < len(queue) and len(scheduler.running) < scheduler.max_num_seqs:
        left = scheduler.max_num_batched_tokens - used
        if left <= 0:
            break
        n = scheduler.try_admit(queue[i], left, out)
        if not n:
            break
        used += n
        i += 1
    return out


def _decodes(scheduler, out, budget, check_status=True):
    for seq in scheduler.running_in_order():
        if budget == 0:
            break
        if check_status and seq.status is not SequenceStatus.RUNNING:
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and scheduler.reserve(seq, n, out):
            budget -= n
    return budget


def _admit(scheduler, out, budget, order=None, fcfs=True, after_preempt=False):
    if out.preempted and not after_preempt:
        return
    for seq in order if order is not None else scheduler.waiting_in_order():
        if len(scheduler.running) >= scheduler.max_num_seqs or budget == 0:
            break
        n = scheduler.try_admit(seq, budget, out)
        if n == 0:
            if fcfs:
                break
            continue
        budget -= n


def schedule_static_like(scheduler):
    out = SchedulerOutput()
    budget = _decodes(scheduler, out, scheduler.max_num_batched_tokens)
    if not scheduler.running:
        _admit(scheduler, out, budget)
    return out


def schedule_admit_only(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, scheduler.max_num_batched_tokens)
    return out


def schedule_no_status_check(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _decodes(scheduler, out, scheduler.max_num_batched_tokens, check_status=False))
    return out


def schedule_admits_after_preempting(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _decodes(scheduler, out, scheduler.max_num_batched_tokens), after_preempt=True)
    return out


def schedule_newest_first(scheduler):
    out = SchedulerOutput()
    budget = _decodes(scheduler, out, scheduler.max_num_batched_tokens)
    _admit(scheduler, out, budget, order=scheduler.waiting_in_order()[::-1])
    return out


def schedule_over_budget(scheduler):
    out = SchedulerOutput()
    for seq in scheduler.running_in_order():
        if seq.status is SequenceStatus.RUNNING:
            n = scheduler.tokens_to_run(seq, scheduler.max_num_batched_tokens, out)
            if n:
                scheduler.reserve(seq, n, out)
    _admit(scheduler, out, scheduler.max_num_batched_tokens)
    return out


right("check_continuous_schedule", schedule_continuous)
right("check_continuous_schedule", schedule_continuous_queue)
wrong("check_continuous_schedule", "static batching", schedule_static_like)
wrong("check_continuous_schedule", "unfinished", schedule_admit_only)
wrong("check_continuous_schedule", "preempted earlier in the same step", schedule_no_status_check)
wrong("check_continuous_schedule", "admit only in a step that preempted nothing", schedule_admits_after_preempting)
wrong("check_continuous_schedule", "first come, first served", schedule_newest_first)
wrong("check_continuous_schedule", "over the budget", schedule_over_budget)


# ---- ch04: more wrong answers a learner writes


# ---- chunk_tokens ---------------------------------------------------------------------------


def _chunk_empty_step_gets_budget(remaining, budget, chunked_prefill, step_is_empty):
    if chunked_prefill or remaining <= budget:
        return min(remaining, budget)
    return budget if step_is_empty else 0  # a long prompt alone in a step: as much as the budget allows


def _chunk_modes_swapped(remaining, budget, chunked_prefill, step_is_empty):
    if not chunked_prefill:
        return min(remaining, budget)
    return remaining if remaining <= budget or step_is_empty else 0


def _chunk_numpy(remaining, budget, chunked_prefill, step_is_empty):
    if chunked_prefill:
        return np.minimum(remaining, budget)
    return remaining if remaining <= budget or step_is_empty else 0


def _chunk_fits_inverted(remaining, budget, chunked_prefill, step_is_empty):
    if chunked_prefill:
        return min(remaining, budget)
    return remaining if remaining >= budget or step_is_empty else 0


def _chunk_empty_step_first(remaining, budget, chunked_prefill, step_is_empty):
    if step_is_empty:
        return remaining  # alone in the step: the whole thing
    if chunked_prefill:
        return min(remaining, budget)
    return remaining if remaining <= budget else 0


def _chunk_leaves_one(remaining, budget, chunked_prefill, step_is_empty):
    if chunked_prefill:
        if remaining == 1:
            return min(1, budget)  # a decode
        return min(remaining, max(budget - 1, 0))  # a prompt chunk leaves a token for a decode
    return remaining if remaining <= budget or step_is_empty else 0


def _chunk_flags_swapped(remaining, budget, step_is_empty, chunked_prefill):
    return chunk_tokens(remaining, budget, chunked_prefill, step_is_empty)


def _chunk_counts_swapped(budget, remaining, chunked_prefill, step_is_empty):
    return chunk_tokens(remaining, budget, chunked_prefill, step_is_empty)


wrong(
    "check_chunk_tokens", "and alone in an empty step it runs whole even past the budget", _chunk_empty_step_gets_budget
)
wrong("check_chunk_tokens", "the rule with chunked_prefill read backwards", _chunk_modes_swapped)
wrong("check_chunk_tokens", "chunk_tokens should return an int, got int64", _chunk_numpy)
wrong("check_chunk_tokens", "returned 0, expected 10: a prompt that fits runs whole", _chunk_fits_inverted)
wrong("check_chunk_tokens", "even the first sequence of a step takes no more than the budget", _chunk_empty_step_first)
wrong(
    "check_chunk_tokens",
    "returned 15, expected 16: with chunked prefill a long prompt takes what is left of the budget",
    _chunk_leaves_one,
)
wrong("check_chunk_tokens", "the rule with chunked_prefill and step_is_empty swapped", _chunk_flags_swapped)
wrong("check_chunk_tokens", "the rule with remaining and budget swapped", _chunk_counts_swapped)

# ---- choose_victim --------------------------------------------------------------------------


def _victim_by_fields(seq, candidates):
    """Independent: ranks by the fields sort_key is made of (priority, then arrival time)."""

    def rank(s):
        return (s.priority, s.metrics.arrival_time)

    worst = seq
    for candidate in candidates:
        if rank(candidate) > rank(worst):
            worst = candidate
    return worst


def _victim_priority_only(seq, candidates):
    victim = max(candidates, key=lambda s: s.sort_key[0], default=seq)
    return seq if victim.sort_key < seq.sort_key else victim


def _victim_urgent_is_large(seq, candidates):
    def rank(s):  # a larger priority number taken as more urgent
        return (-s.sort_key[0], s.sort_key[1])

    victim = max(candidates, key=rank, default=seq)
    return seq if rank(victim) < rank(seq) else victim


def _victim_no_default(seq, candidates):
    victim = max(candidates, key=lambda s: s.sort_key)
    return seq if victim.sort_key < seq.sort_key else victim


def _victim_yield_backwards(seq, candidates):
    victim = max(candidates, key=lambda s: s.sort_key, default=seq)
    return seq if victim.sort_key > seq.sort_key else victim


def _victim_index(seq, candidates):
    ranked = [seq, *candidates]
    return max(range(len(ranked)), key=lambda i: ranked[i].sort_key)


def _victim_yield_on_priority(seq, candidates):
    victim = max(candidates, key=lambda s: s.sort_key, default=seq)
    return seq if victim.priority < seq.priority else victim


def _victim_earliest_among_equals(seq, candidates):
    victim = min(candidates, key=lambda s: (-s.sort_key[0], s.sort_key[1]), default=seq)
    return seq if victim.sort_key < seq.sort_key else victim


right("check_choose_victim", _victim_by_fields)
wrong(
    "check_choose_victim",
    "returned B(priority 0, arrived 2nd), expected C(priority 0, arrived 3rd): the latest arrival among equals",
    _victim_priority_only,
)
wrong("check_choose_victim", "a lower priority (a larger priority number) goes first", _victim_urgent_is_large)
wrong(
    "check_choose_victim",
    "with no candidate left, seq itself must yield: return seq when candidates is empty",
    _victim_no_default,
)
wrong(
    "check_choose_victim",
    "you returned seq itself, yet C(priority 0, arrived 3rd) ranks below it",
    _victim_yield_backwards,
)
wrong("check_choose_victim", "returned 2, which is neither seq nor one of the candidates", _victim_index)
wrong(
    "check_choose_victim",
    "with equal priorities the earlier arrival, A(priority 0, arrived 1st), outranks",
    _victim_yield_on_priority,
)
wrong(
    "check_choose_victim",
    "returned B(priority 0, arrived 2nd), expected C(priority 0, arrived 3rd): the latest arrival",
    _victim_earliest_among_equals,
)

# ---- schedule_continuous --------------------------------------------------------------------


def _running_first(scheduler, out, order=None, decodes_only=False, trust_reserve=True):
    """The running sequences' tokens (as the solution schedules them, unless told otherwise); the budget left.
    ``trust_reserve=False``: their tokens come off the budget whatever ``reserve`` returned."""
    budget = scheduler.max_num_batched_tokens
    for seq in scheduler.running_in_order() if order is None else order:
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING or (decodes_only and not seq.is_decoding):
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and (scheduler.reserve(seq, n, out) or not trust_reserve):
            budget -= n
    return budget


def _sched_admit_keeps_budget(scheduler):
    out = SchedulerOutput()
    budget = _running_first(scheduler, out)
    if not out.preempted:
        for seq in scheduler.waiting_in_order():
            if len(scheduler.running) >= scheduler.max_num_seqs or budget == 0:
                break
            if scheduler.try_admit(seq, budget, out) == 0:
                break  # (the admitted tokens are never taken off the budget)
    return out


def _admit_seats(scheduler, out, budget, seats_full):
    if out.preempted:
        return
    for seq in scheduler.waiting_in_order():
        if seats_full(len(scheduler.running), scheduler.max_num_seqs) or budget == 0:
            break
        n = scheduler.try_admit(seq, budget, out)
        if n == 0:
            break
        budget -= n


def _sched_no_seat_limit(scheduler):
    out = SchedulerOutput()
    _admit_seats(scheduler, out, _running_first(scheduler, out), lambda running, seats: False)
    return out


def _sched_one_seat_too_many(scheduler):
    out = SchedulerOutput()
    _admit_seats(scheduler, out, _running_first(scheduler, out), lambda running, seats: running > seats)
    return out


def _sched_skips_refused(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _running_first(scheduler, out), fcfs=False)
    return out


def _sched_running_unsorted(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _running_first(scheduler, out, order=list(scheduler.running)))
    return out


def _sched_waiting_unsorted(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _running_first(scheduler, out), order=list(scheduler.waiting))
    return out


def _sched_decodes_only(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _running_first(scheduler, out, decodes_only=True))
    return out


def _sched_admits_first(scheduler):
    out = SchedulerOutput()
    budget = scheduler.max_num_batched_tokens
    for seq in scheduler.waiting_in_order():
        if len(scheduler.running) >= scheduler.max_num_seqs or budget == 0:
            break
        n = scheduler.try_admit(seq, budget, out)
        if n == 0:
            break
        budget -= n
    admitted = list(out.admitted)
    for seq in scheduler.running_in_order():
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING or seq in admitted:
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and scheduler.reserve(seq, n, out):
            budget -= n
    return out


wrong("check_continuous_schedule", "(0 for running sequences, 32 for newly admitted ones)", _sched_admit_keeps_budget)
wrong(
    "check_continuous_schedule",
    "more than max_num_seqs=4: admit only while len(scheduler.running) < max_num_seqs",
    _sched_no_seat_limit,
)
wrong("check_continuous_schedule", "more than max_num_seqs=4", _sched_one_seat_too_many)
wrong(
    "check_continuous_schedule",
    "request 3 did not fit, and the step went on to try request 4 behind it",
    _sched_skips_refused,
)
wrong("check_continuous_schedule", "behind it in scheduler.running_in_order()", _sched_running_unsorted)
wrong(
    "check_continuous_schedule",
    "tried to admit request 4 before request 3, ahead of it in scheduler.waiting_in_order()",
    _sched_waiting_unsorted,
)
wrong(
    "check_continuous_schedule",
    "(prefilling, 18 tokens still to compute), but the step left it out",
    _sched_decodes_only,
)
wrong(
    "check_continuous_schedule", "the step admitted request 1 before scheduling running request 0", _sched_admits_first
)


def _schedule_stops_with_one_token_left(scheduler):
    """Stops admitting when 1 budget token is left (`budget <= 1`): a prompt chunk of 1 never starts."""
    out = SchedulerOutput()
    budget = scheduler.max_num_batched_tokens
    for seq in scheduler.running_in_order():
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING:
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and scheduler.reserve(seq, n, out):
            budget -= n
    if not out.preempted:
        for seq in scheduler.waiting_in_order():
            if len(scheduler.running) >= scheduler.max_num_seqs or budget <= 1:
                break
            n = scheduler.try_admit(seq, budget, out)
            if n == 0:
                break
            budget -= n
    return out


wrong("check_continuous_schedule", "a chunk of a single token", _schedule_stops_with_one_token_left)


def _schedule_ignores_reserve(scheduler):
    """Takes every running sequence's tokens off the budget, whatever ``reserve`` returned (False:
    the sequence was preempted itself, and nothing was scheduled for it)."""
    out = SchedulerOutput()
    _admit(scheduler, out, _running_first(scheduler, out, trust_reserve=False))
    return out


wrong("check_continuous_schedule", "take n off the budget only when reserve returns True", _schedule_ignores_reserve)


def _sched_static(scheduler):
    """Static batching: newcomers wait until every running sequence has finished."""
    out = SchedulerOutput()
    was_empty = not scheduler.running
    budget = _running_first(scheduler, out)
    _admit_seats(scheduler, out, budget, lambda running, seats: running >= seats or not was_empty)
    return out


wrong("check_continuous_schedule", "3 of its 4 seats free: that is static batching", _sched_static)


# ---- Chapter 04's runner inputs (``check_prepare_inputs``): right answers written independently, and the
# wrong ones a learner writes, one slip each (``build(...)`` switches it on).


PI = "check_prepare_inputs"


def build(**slip):
    def prepare_inputs(chunks, block_size, null_block):
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        order = list(chunks) if slip.get("keep_order") else decodes + [c for c in chunks if len(c.token_ids) > 1]
        out = dict(input_ids=[], positions=[], slot_mapping=[], query_lens=[], context_lens=[])
        for c in order:
            n = len(c.token_ids)
            out["input_ids"] += c.token_ids
            for i, p in enumerate(range(c.start, c.start + n)):
                out["positions"].append(i if slip.get("positions_from_zero") else p)
                if slip.get("slot_is_position"):
                    out["slot_mapping"].append(p)
                elif slip.get("slot_no_multiply"):
                    out["slot_mapping"].append(c.block_table[p // block_size] + p % block_size)
                else:
                    out["slot_mapping"].append(c.block_table[p // block_size] * block_size + p % block_size)
            out["query_lens"].append(n)
            out["context_lens"].append(n if slip.get("context_is_n") else c.start + n)
        width = max(-(-n // block_size) for n in out["context_lens"])
        if slip.get("widest_table"):
            width = max(len(c.block_table) for c in order)
        pad = 0 if slip.get("pad_zero") else null_block
        if slip.get("ragged"):
            out["block_tables"] = [list(c.block_table) for c in order]
        else:
            out["block_tables"] = [(c.block_table + [pad] * width)[:width] for c in order]
        out["num_decodes"] = len(chunks) if slip.get("all_decodes") else len(decodes)
        ends = dict(zip(map(id, order), itertools.accumulate(out["query_lens"])))
        listed = order if slip.get("rows_in_flat_order") else chunks
        if slip.get("one_row_each"):
            out["logit_rows"] = [ends[id(c)] - 1 for c in listed]
        else:
            out["logit_rows"] = [ends[id(c)] - k for c in listed for k in range(c.num_logits, 0, -1)]
        return out

    return prepare_inputs


def prepare_b(chunks, block_size, null_block):
    """Index arithmetic with two passes and decodes sorted by start, as the engine does."""
    decodes = sorted((c for c in chunks if len(c.token_ids) == 1), key=lambda c: c.start)
    order = decodes + [c for c in chunks if len(c.token_ids) != 1]
    starts = [0]
    for c in order:
        starts.append(starts[-1] + len(c.token_ids))
    positions = [c.start + i for c in order for i in range(len(c.token_ids))]
    tables = [c.block_table for c in order for _ in c.token_ids]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    contexts = [c.start + len(c.token_ids) for c in order]
    width = (max(contexts) + block_size - 1) // block_size
    index = {id(c): k for k, c in enumerate(order)}
    rows = []
    for c in chunks:
        end = starts[index[id(c)] + 1]
        rows.extend(range(end - c.num_logits, end))
    return {
        "input_ids": [t for c in order for t in c.token_ids],
        "positions": positions,
        "slot_mapping": slots,
        "query_lens": [len(c.token_ids) for c in order],
        "context_lens": contexts,
        "block_tables": [c.block_table[:width] + [null_block] * (width - len(c.block_table[:width])) for c in order],
        "num_decodes": len(decodes),
        "logit_rows": rows,
    }


def prepare_in_place(chunks, block_size, null_block):
    """Pads the chunks' own block tables (``c.block_table += ...``): the sequences' tables grow."""
    out = build()(chunks, block_size, null_block)
    width = len(out["block_tables"][0])
    for c in chunks:
        c.block_table += [null_block] * (width - len(c.block_table))
    return out


def prepare_tuple(chunks, block_size, null_block):
    return tuple(build()(chunks, block_size, null_block).values())


def prepare_missing_rows(chunks, block_size, null_block):
    out = build()(chunks, block_size, null_block)
    del out["logit_rows"]
    return out


right(PI, build())
right(PI, prepare_b)

for slip, message in (
    ({"keep_order": True}, "put the decodes (one-token chunks) first"),
    ({"positions_from_zero": True}, "positions start at 0 for every chunk"),
    ({"slot_is_position": True}, "slot_mapping is the position itself"),
    ({"slot_no_multiply": True}, "multiply the block id by block_size first"),
    ({"context_is_n": True}, "context_lens counts only the new tokens"),
    ({"pad_zero": True}, "pad with null_block, which no sequence owns"),
    ({"ragged": True}, "block_tables have one length per sequence"),
    ({"widest_table": True}, "as wide as the longest block table"),
    ({"all_decodes": True}, "num_decodes counts every chunk"),
    ({"rows_in_flat_order": True}, "list them in the order of `chunks`"),
    ({"one_row_each": True}, "a chunk wants its last num_logits rows"),
):
    wrong(PI, message, build(**slip))
wrong(PI, "changed a chunk's token_ids or block_table", prepare_in_place)
wrong(PI, "should return a dict", prepare_tuple)
wrong(PI, "dict has no logit_rows", prepare_missing_rows)


# ---- Chapter 04's blocks of a step (``check_reserve_admit``): two right answers written independently,
# and the wrong ones a learner writes, one slip each (``reserve_with`` / ``admit_with``).


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
