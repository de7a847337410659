"""Chapter 04: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import numpy as np
from check_catalogue import _admit, chunk_tokens, right, wrong

from minillm.engine.scheduler import SchedulerOutput
from minillm.sequence import SequenceStatus

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
