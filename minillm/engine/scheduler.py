"""The scheduler: each step, which sequences run and how many of their tokens.

Three batching policies share one mechanism, so a chapter can compare them on one workload:

- ``static``: when the engine is idle, take up to ``max_num_seqs`` waiting requests as a batch
  and run it until *every* member has finished; newcomers wait for the whole batch.
- ``dynamic``: the same, but a batch only starts once ``max_num_seqs`` requests are waiting or
  the oldest has waited ``batch_timeout`` seconds (fuller batches, at a latency price).
- ``continuous``: decisions are made every step — a finished request's place is given to a
  waiting one at once (iteration-level scheduling, as in Orca and vLLM).

Every step spends a **token budget** (``max_num_batched_tokens``): running decodes first
(one token each), then prefills. With **chunked prefill** a long prompt is cut to fit what
is left of the budget and finished in later steps, so one big prompt never stalls everybody's
decoding for a whole long step. Without it a prompt is prefilled in one step.

When a sequence needs a block and the pool is empty, the scheduler **preempts** the running
sequence that comes last in priority order: its blocks are freed and it returns to the
waiting queue with the tokens it has generated, to be recomputed (quickly, if its prefix is
still cached) when there is room again. A request is never lost or duplicated: it is always in
exactly one of ``waiting``, ``running`` or finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import minillm.hooks as hooks
from minillm.config import SCHEDULING_POLICIES
from minillm.kvcache.block_manager import BlockManager
from minillm.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``start`` run this step.

    ``samples``: the chunk reaches the end of the sequence, so a next token is sampled from
    its last position (a prefill chunk that stops mid-prompt does not). Fixed when scheduled:
    the sequence grows once the token is appended. ``draft_tokens``: speculative proposals
    run after the sequence's last token (a verify chunk: ``num_tokens`` counts them too).
    ``num_logits``: how many of the chunk's last positions need logits — 1 when it samples,
    ``1 + len(draft_tokens)`` when it verifies.
    """

    seq: Sequence
    start: int
    num_tokens: int
    draft_tokens: list[int] = field(default_factory=list)
    samples: bool = field(init=False)
    num_logits: int = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens - len(self.draft_tokens) == len(self.seq)
        self.num_logits = int(self.samples) + len(self.draft_tokens)

    @classmethod
    def decode(cls, seq: Sequence) -> ScheduledChunk:
        """``ScheduledChunk(seq, seq.num_computed_tokens, 1)`` for a decoding ``seq``, without the
        arithmetic of ``__post_init__``: it samples, one logit (built for every sequence of a
        decode step)."""
        chunk = cls.__new__(cls)
        chunk.seq, chunk.start, chunk.num_tokens, chunk.draft_tokens = seq, seq.num_computed_tokens, 1, []
        chunk.samples, chunk.num_logits = True, 1
        return chunk

    @property
    def is_decode(self) -> bool:
        """A sequence past its prompt, running its one new token (the scheduler's sense of "decode")."""
        return self.num_tokens == 1 and self.samples  # == seq.is_decoding when scheduled


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies, done first
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        policy: str = "continuous",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        batch_timeout: float = 0.05,
        window: int | None = None,
    ):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={policy!r}; expected one of {SCHEDULING_POLICIES}")
        self.block_manager = block_manager  # or a NoBlockPool (naive, contiguous rungs)
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.batch_timeout = batch_timeout
        self.window = window  # sliding-window attention: blocks behind it go back to the pool
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """A sample just forked from a running sequence (``BlockManager.fork`` gave it its
        blocks, its first token is appended): it runs from the next step on, like any other."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Forget a finished (or aborted) sequence and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def queued_for_a_place(self) -> int:
        """Requests a place freed now would go to: the waiting ones under continuous batching;
        none under static or dynamic batching, whose newcomers wait for the whole batch (what
        the speculation governor weighs a step by: ``Speculator.step_done``)."""
        return len(self.waiting) if self.policy == "continuous" else 0

    def block_table(self, seq: Sequence) -> list[int]:
        return self.block_manager.block_table_of(seq)

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """After the model ran ``chunks``: register blocks that filled in the prefix cache and
        release blocks that fell behind the sliding window."""
        for chunk in chunks:
            self.block_manager.commit(chunk.seq)
            if self.window is not None:
                self.block_manager.release_behind_window(chunk.seq, self.window)

    # ----------------------------------------------------------------------------------------
    # One step
    # ----------------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Decide this step's work: which sequences run, how many tokens each — through hook
        ``schedule`` (the policy of chapter 04's exercise; the reference is ``schedule`` below)."""
        self._now = now  # stamps first_scheduled_time of the sequences this step starts
        return hooks.schedule(self, now)

    # ----------------------------------------------------------------------------------------
    # The building blocks of a step (also what the chapter's exercise is written with)
    # ----------------------------------------------------------------------------------------

    def running_in_order(self) -> list[Sequence]:
        """Running sequences, decodes first (cheap, and a user waits on each token), then
        prefills in progress; each group by priority, then arrival."""
        return sorted(self.running, key=lambda s: (not s.is_decoding, s.sort_key))

    def waiting_in_order(self) -> list[Sequence]:
        return sorted(self.waiting, key=lambda s: s.sort_key)

    def tokens_to_run(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """How many of ``seq``'s uncomputed tokens fit in what is left of the budget (0: none):
        hook ``tokens_to_run``."""
        return hooks.tokens_to_run(self, seq, budget, out)

    def drafts_that_fit(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """The speculative proposals a decoding ``seq`` runs this step: as many as the budget
        leaves room for, and none when the pool cannot take them without preempting anyone
        (a plain decode then, the proposals are only a bet)."""
        if n != 1 or not seq.draft_tokens or not seq.is_decoding:
            return []
        drafts = seq.draft_tokens[: budget - 1]
        if drafts and not self.block_manager.can_allocate(seq, 1 + len(drafts)):
            return []
        return drafts

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the K/V of ``seq`` past its first ``num_tokens`` tokens (rejected proposals)."""
        self.block_manager.truncate(seq, num_tokens)

    def reserve(self, seq: Sequence, n: int, out: SchedulerOutput, drafts: list[int] = ()) -> bool:
        """Schedule ``n`` tokens of running ``seq`` (plus its ``drafts``), preempting while the
        pool is full; False when ``seq`` itself was preempted: hook ``reserve``."""
        return hooks.reserve(self, seq, n, out, drafts)

    def reserve_decodes(self, running: list[Sequence], budget: int, out: SchedulerOutput) -> int:
        """The steady state of a step at once: one token for each of the plain decodes that lead
        ``running`` (past the prompt, no speculative proposals), as many as ``budget`` allows,
        when the pool has room for every one of them. Returns how many were scheduled — 0 when
        it did nothing, and the caller goes sequence by sequence.

        What ``tokens_to_run`` and ``reserve`` decide for such a sequence (one token, a slot,
        nobody preempted), without calling them per sequence: at 1,024 sequences that walk was
        the largest part of the engine's own work in a step (``benchmarks/bench_step_overhead.py``).
        So only while both are the package's own: a chapter-04 exercise's replacement is called
        for every sequence, as always."""
        if hooks.tokens_to_run is not tokens_to_run or hooks.reserve is not reserve:
            return 0
        n, running_status = 0, SequenceStatus.RUNNING
        for seq in running:
            if n == budget or len(seq) - seq.num_computed_tokens != 1 or seq.draft_tokens or seq.status is not running_status:
                break
            n += 1
        decodes = running[:n]
        copies = self.block_manager.allocate_decode_slots(decodes) if n else None
        if copies is None:
            return 0
        out.chunks.extend([ScheduledChunk.decode(seq) for seq in decodes])
        out.copies.extend(copies)
        return n

    def choose_victim(self, seq: Sequence, candidates: list[Sequence]) -> Sequence:
        """Who gives up its blocks so that ``seq`` can grow: hook ``choose_victim``."""
        return hooks.choose_victim(self, seq, candidates)

    def try_admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Start waiting ``seq`` if its first chunk fits; the tokens scheduled: hook ``try_admit``."""
        return hooks.try_admit(self, seq, budget, out)

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks, keep the tokens, wait again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.append(seq)
        out.preempted.append(seq)

    def start(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Waiting ``seq`` runs from this step on (its blocks are already reserved)."""
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = self._now
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.running.append(seq)
        out.admitted.append(seq)

    def batch_ready(self, now: float) -> bool:
        """Static: whenever requests wait. Dynamic: when ``max_num_seqs`` wait or the oldest has
        waited ``batch_timeout``."""
        if not self.waiting:
            return False
        if self.policy == "static":
            return True
        oldest = min(s.metrics.arrival_time for s in self.waiting)
        return len(self.waiting) >= self.max_num_seqs or now - oldest >= self.batch_timeout

    def start_batch(self, out: SchedulerOutput) -> None:
        """Static/dynamic: the batch is fixed now, as many as fit (prompts' blocks) up to ``max_num_seqs``."""
        free = self.block_manager.num_free_blocks
        seats = self.max_num_seqs  # a request with n samples takes n (it forks after its prefill)
        for seq in self.waiting_in_order():
            need = self.block_manager.blocks_for(len(seq))
            if seq.fan_out > seats or (self.running and need > free):
                break
            free -= need
            seats -= seq.fan_out
            self.block_manager.match_prefix(seq)
            self.waiting.remove(seq)
            self.start(seq, out)


# ---------------------------------------------------------------------------------------------
# The reference policy: what hooks schedule, tokens_to_run, reserve, choose_victim and try_admit
# run unless a chapter-04 exercise overrides them. Each takes the scheduler first and is
# written with its public building blocks, as a learner's replacement is.
# ---------------------------------------------------------------------------------------------


@hooks.reference("schedule")
def schedule(scheduler: Scheduler, now: float) -> SchedulerOutput:
    """One step: static and dynamic batches start when ready; then running sequences, decodes
    first, each as many tokens as the budget leaves (with its speculative proposals when they
    fit); then — continuous batching, and only in a step that preempted nobody — waiting
    sequences in FCFS order while seats, budget and blocks last."""
    out = SchedulerOutput()
    if scheduler.policy != "continuous" and not scheduler.running and scheduler.batch_ready(now):
        scheduler.start_batch(out)
    budget = scheduler.max_num_batched_tokens
    running = scheduler.running_in_order()
    steady = scheduler.reserve_decodes(running, budget, out)  # the plain decodes at once, if they all fit
    budget -= steady
    for seq in running[steady:]:
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING:
            continue  # preempted earlier in this step to make room for a sequence ahead of it
        n = scheduler.tokens_to_run(seq, budget, out)
        drafts = scheduler.drafts_that_fit(seq, n, budget)
        if n and scheduler.reserve(seq, n, out, drafts):
            budget -= n + len(drafts)
    if scheduler.policy == "continuous" and not out.preempted:  # no newcomers while evicting
        for seq in scheduler.waiting_in_order():
            # a request with n samples will fork into n running sequences: room for all of them
            if len(scheduler.running) + seq.fan_out > scheduler.max_num_seqs or budget == 0:
                break
            n = scheduler.try_admit(seq, budget, out)
            if n == 0:
                break  # FCFS: nobody overtakes the head of the queue
            budget -= n
    return out


@hooks.reference("tokens_to_run")
def tokens_to_run(scheduler: Scheduler, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
    """How many of ``seq``'s uncomputed tokens fit in what is left of the budget (0: none)."""
    remaining = len(seq) - seq.num_computed_tokens
    if scheduler.enable_chunked_prefill:
        return min(remaining, budget)
    # Whole prompts only; a prompt larger than the whole budget may run alone in a step.
    return remaining if remaining <= budget or not out.chunks else 0


@hooks.reference("reserve")
def reserve(scheduler: Scheduler, seq: Sequence, n: int, out: SchedulerOutput, drafts: list[int] = ()) -> bool:
    """Schedule ``n`` tokens of running ``seq`` (plus its speculative ``drafts``), allocating
    blocks for them. When the pool is full, preempt the lowest-priority running sequence not
    yet scheduled this step — which may be ``seq`` itself (then return False)."""
    drafts = list(drafts)
    while (copies := scheduler.block_manager.allocate_slots(seq, n + len(drafts))) is None:
        scheduled = [c.seq for c in out.chunks]
        candidates = [s for s in scheduler.running if s is not seq and s not in scheduled]
        victim = scheduler.choose_victim(seq, candidates)
        scheduler.preempt(victim, out)
        if victim is seq:
            return False
    out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n + len(drafts), drafts))
    out.copies.extend(copies)
    return True


@hooks.reference("choose_victim")
def choose_victim(scheduler: Scheduler, seq: Sequence, candidates: list[Sequence]) -> Sequence:
    """The lowest-priority candidate (the latest to arrive among equals) — or ``seq`` itself
    when every candidate outranks it or there is none. Sequences already scheduled this step
    are not candidates: their tokens are in the batch."""
    victim = max(candidates, key=lambda s: s.sort_key, default=seq)
    return seq if victim.sort_key < seq.sort_key else victim


@hooks.reference("try_admit")
def try_admit(scheduler: Scheduler, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
    """Start waiting ``seq`` if its first chunk fits the budget and the pool; return the tokens
    scheduled (0: it stays waiting, nothing changed)."""
    scheduler.block_manager.match_prefix(seq)  # cached prefix blocks need no compute
    n = scheduler.tokens_to_run(seq, budget, out)
    copies = scheduler.block_manager.allocate_slots(seq, n) if n else None
    if copies is None:
        scheduler.block_manager.cancel_prefix(seq)
        return 0
    scheduler.waiting.remove(seq)
    scheduler.start(seq, out)
    out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
    out.copies.extend(copies)
    return n
