"""The scheduler of the first two rungs (naive, contiguous cache): one static batch at a time.

When nothing runs, up to ``max_num_seqs`` waiting requests (in priority order) become a batch
that runs until every member has finished; newcomers wait for the whole batch. Every step
runs every member: with ``recompute`` (the naive rung) each chunk is the whole sequence from
position 0, otherwise the prompt once and then one token per step. There is no KV pool to
manage: memory is the contiguous runner's slab, reported here as its reservation.
"""

from __future__ import annotations

from minillm.engine.scheduler import PoolStats, ScheduledChunk, SchedulerOutput
from minillm.sequence import Sequence, SequenceStatus


class StaticBatcher:
    def __init__(self, max_num_seqs: int = 64, recompute: bool = False):
        self.max_num_seqs = max_num_seqs
        self.recompute = recompute
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._slab_slots = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running and self.waiting:
            batch = sorted(self.waiting, key=lambda s: s.sort_key)[: self.max_num_seqs]
            for seq in batch:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                seq.metrics.first_scheduled_time = now
                self.running.append(seq)
            out.admitted = list(batch)
            # The contiguous runner's slab: a row per member, each as long as the longest may grow.
            self._slab_slots = len(batch) * max(len(s.prompt_token_ids) + s.max_output for s in batch)
        for seq in self.running:
            start = 0 if self.recompute else seq.num_computed_tokens
            out.chunks.append(ScheduledChunk(seq, start, len(seq) - start))
        return out

    def block_table(self, seq: Sequence) -> None:
        return None  # no paged pool

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        pass

    def pool_stats(self) -> PoolStats:
        if self.recompute or not self.running:
            return PoolStats()  # the naive rung keeps nothing between steps
        stored = sum(s.num_computed_tokens for s in self.running)
        return PoolStats(tokens_stored=stored, reserved_slots=self._slab_slots, wasted_slots=self._slab_slots - stored)
