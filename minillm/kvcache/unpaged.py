"""The stand-in for the block manager on the first two rungs (naive, contiguous cache).

They keep no paged pool — the contiguous runner holds one slab per static batch, the naive
runner nothing — so the scheduler's allocations always succeed and there is nothing to
cache, share, copy or release. With it the one ``Scheduler`` (policy ``static``) drives
every rung of the ladder.
"""

from __future__ import annotations

import sys

from minillm.kvcache.block_manager import PoolStats


class NoBlockPool:
    block_size = 1
    num_free_blocks = sys.maxsize

    def blocks_for(self, num_tokens: int) -> int:
        return 0

    def match_prefix(self, seq) -> int:
        seq.num_computed_tokens = 0
        return 0

    def allocate_slots(self, seq, num_new_tokens: int) -> list[tuple[int, int]]:
        return []

    def allocate_decode_slots(self, seqs) -> list[tuple[int, int]]:
        return []

    def block_table_of(self, seq) -> None:
        return None

    def free(self, seq) -> None:
        pass

    cancel_prefix = commit = free

    def pool_stats(self) -> PoolStats:
        return PoolStats()  # no pool: every field None, and reports leave these steps out
