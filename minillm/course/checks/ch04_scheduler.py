"""Chapter 04 (batching): the chunking rule, the preemption victim, the continuous-batching step."""

from __future__ import annotations

import types

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.checks.engines import (
    PROMPTS,
    assert_pool_clean,
    compare_request_tokens,
    contiguous_reference,
    greedy_params,
    paged_engine,
    pool_bytes,
    run_arriving,
)
from minillm.course.compare import int_cases
from minillm.course.results import CheckError, CheckFailed, check, learner_cause


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

    # First the hand-made states: each is reached by the package's scheduler, then one step (or the
    # rest of the run) goes to yours, whose right outcome is known — the per-step verdicts above and
    # the checks after each step name what went wrong. Then the workload.
    yours = dict(schedule=schedule_step, reserve=reserve, try_admit=try_admit, tokens_to_run=tokens_to_run)
    # Request 0 (priority 1) is ahead of the more urgent request 1 (priority 0) in scheduler.running,
    # both decoding, and one step has a budget of one token: it goes to request 1.
    small = paged_engine(model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    for priority in (1, 0):
        small.add_request(PROMPTS[4], greedy_params(), priority=priority)
        small.step()
    if [q.priority for q in small.scheduler.running] != [1, 0] or not all(
        q.is_decoding for q in small.scheduler.running
    ):
        raise CheckError("the hand-made state (two decoding requests, the less urgent first) was not reached")
    next_budget.append(1)
    with hooks.override(**yours):
        small.step()
    # One request decoding, one waiting: with the whole budget the newcomer joins in this step; with a
    # budget of 2 (chunked prefill, the default) too — the decode takes 1 token and the newcomer's
    # prompt starts with a chunk of the 1 left.
    for step_budget in (None, 2):
        state = paged_engine(model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
        state.add_request(PROMPTS[4], greedy_params())
        state.step()
        decoding = state.scheduler.running[0]
        if not decoding.is_decoding:
            raise CheckError("the hand-made state (one request decoding) was not reached")
        state.add_request(PROMPTS[3], greedy_params())
        newcomer = state.scheduler.waiting[0]
        if step_budget is not None:
            next_budget.append(step_budget)
        with hooks.override(**yours):
            state.step()
        if newcomer.status is SequenceStatus.RUNNING:
            continue
        if step_budget is None:
            raise CheckFailed(
                f"request {newcomer.request_id} waited while request {decoding.request_id} decoded, with "
                f"{budget - 1} of the step's {budget} budget tokens and 3 of its 4 seats free: that is static "
                "batching. Admit waiting sequences in the same step as the running ones, while seats, budget and "
                "blocks last"
            )
        raise CheckFailed(
            f"a step with a budget of 2 ran request {decoding.request_id}'s decode and left 1 token unused while "
            f"request {newcomer.request_id} waited: with chunked prefill a prompt may start "
            "with a chunk of a single token — admit while any budget is left (budget > 0)"
        )
    # A full pool of 9 blocks: request A (priority 1) decodes into a new block while the more urgent B
    # still prefills its 33-token prompt. reserve preempts A itself (and returns False); B's chunk
    # takes the whole budget. Your scheduler runs both to the end.
    from minillm import SamplingParams

    squeezed = paged_engine(model, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4,
                             kv_cache_memory=pool_bytes(model, 9, 4), enable_prefix_caching=False)  # fmt: skip
    squeezed.add_request(list(range(5, 17)), SamplingParams(max_tokens=12, ignore_eos=True), priority=1)
    for _ in range(2):
        squeezed.step()
    yielding = squeezed.scheduler.running[0]
    squeezed.add_request(list(range(7, 40)), SamplingParams(max_tokens=2, ignore_eos=True), priority=0)
    with hooks.override(**yours):
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
    with hooks.override(**yours):
        steps.clear()  # the workload's steps only: the hand-made ones say nothing about joining
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
    return (
        f"{len(PROMPTS)} requests arriving mid-run all finished under your scheduler, {len(joined)} steps admitted "
        f"newcomers next to running decodes, {preemptions} preemptions in a 24-block pool; tokens identical to "
        "running each alone"
    )
