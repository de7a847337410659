"""``EngineStats``: what an engine holds right now, as plain numbers (``LLMEngine.stats()``).

Why a snapshot type: the course's checks and the visualisations need a few counts — how many
sequences run and wait, how many KV blocks are in use, how many steps ran — and used to read them
from the scheduler, the block manager and the draft model's pool directly, so reorganising any
of those broke a chapter. The snapshot is the one public place those numbers come from; the
engine's parts may change behind it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """One moment of an engine. KV fields are None where there is no paged pool (the naive and
    contiguous rungs); ``kv_blocks_used + kv_blocks_cached + kv_blocks_free == kv_blocks_total``."""

    num_steps: int  # steps that ran the model since the engine was built (its warm-up excluded)
    num_requests: int  # unfinished requests (a request with n samples counts once)
    num_running: int  # sequences the scheduler runs
    num_waiting: int  # sequences waiting to run: new, or preempted
    kv_blocks_total: int | None = None  # blocks of the paged pool
    kv_blocks_used: int | None = None  # referenced by at least one sequence
    kv_blocks_cached: int | None = None  # unreferenced, kept for the prefix cache (evicted when needed)
    kv_blocks_free: int | None = None  # never used, or evicted
    prefix_cache_queries: int | None = None  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int | None = None  # of those, tokens found cached (not recomputed)
    draft_kv_blocks_used: int | None = None  # the draft model's own pool (None: no draft model)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of the prompt tokens looked up that were found cached (None: no paged pool)."""
        if self.prefix_cache_queries is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @classmethod
    def of(cls, engine) -> EngineStats:
        """The snapshot of ``engine`` (an ``LLMEngine``)."""
        scheduler, bm = engine.scheduler, engine.block_manager
        draft = getattr(engine.speculator, "draft", None)
        pool = {}
        if bm is not None:
            pool = dict(
                kv_blocks_total=bm.num_blocks,
                kv_blocks_used=bm.num_used_blocks,
                kv_blocks_cached=bm.num_cached_blocks,
                kv_blocks_free=bm.num_free_blocks - bm.num_cached_blocks,
                prefix_cache_queries=bm.prefix_queries,
                prefix_cache_hits=bm.prefix_hits,
            )
        return cls(
            num_steps=engine.num_steps,
            num_requests=engine.num_unfinished_requests,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            draft_kv_blocks_used=draft.blocks.num_used_blocks if draft is not None else None,
            **pool,
        )
