"""What crosses the runner boundary: plain step inputs in, logits out.

The engine's loop is the same for every rung of the ladder:

    scheduler.schedule() → StepInputs → runner.execute(inputs) → logits → sample → append

``StepInputs`` holds plain data only — request ids, token ids, positions, block tables, block
copies — never the engine's ``Sequence`` objects (with their tokenizers and random
generators). So a runner can be swapped (naive, contiguous, paged, a quantized or sharded
model), and later live in another process.

**Multi-token contract.** A chunk may ask for logits at several of its positions
(``num_logits``: its last ``num_logits`` tokens), not just the last: a speculative verifier
scores every drafted token in one pass. The runner returns the rows chunk by chunk, in
order. Sampling and appending stay in the engine.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass
class ChunkInput:
    """``token_ids`` of one sequence at positions ``start, start+1, ...`` run this step."""

    request_id: Hashable
    token_ids: list[int]
    start: int
    num_logits: int = 1  # logits for the chunk's last num_logits positions (0: none)
    block_table: list[int] | None = None  # the paged runner's: the sequence's blocks
    max_len: int = 0  # the most tokens the sequence can reach (the contiguous runner reserves it)
    # A tree verify chunk: the parents of its draft nodes, its tokens after the first (-1: the
    # first token, the sequence's last). Node ``i`` lies at address ``start + 1 + i`` in the pool
    # but at position ``start + 1 + depth(i)`` in its branch, and sees only its ancestors.
    tree_parents: list[int] | None = None
    # One token of such a chunk as a row of its own (``fast_path.token_rows``): its position when
    # that is not ``start``, and which of the keys just before it it sees (``visible``, the CPU
    # kernel's ancestor bits; -1: all of them, a plain causal row).
    position: int | None = None
    visible: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> list[int]:
        """Each token's position (RoPE's): its address ``start + i``, except in a tree."""
        if self.position is not None:
            return [self.position]
        if self.tree_parents is None:
            return list(range(self.start, self.start + len(self.token_ids)))
        depths: list[int] = []
        for p in self.tree_parents:
            depths.append(0 if p < 0 else depths[p] + 1)
        return [self.start] + [self.start + 1 + d for d in depths]

    @property
    def is_decode(self) -> bool:
        """One query token: attention reads it against the pool, as a decode step does (it may
        also be the last token of a prompt chunked down to one)."""
        return len(self.token_ids) == 1


@dataclass
class StepInputs:
    chunks: list[ChunkInput]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the pass
    # Also return every token's last hidden state (``runner.last_hidden``: one ``[num_tokens,
    # hidden]`` tensor per chunk, in order): what a feature-level draft (EAGLE) drafts from —
    # the same pass's by-product, not a second forward.
    want_hidden: bool = False

    @property
    def num_logits(self) -> int:
        return sum(c.num_logits for c in self.chunks)


class ModelRunner(Protocol):
    """Runs the model for one step. Implementations: ``NaiveRunner`` (recompute everything),
    ``ContiguousRunner`` (a contiguous KV cache per static batch), ``PagedRunner``."""

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Logits ``[inputs.num_logits, vocab]`` (fp32), chunk by chunk in input order."""

    def release(self, request_id: Hashable) -> None:
        """The request finished or was aborted: drop whatever the runner keeps for it."""


def select_logit_rows(chunks: list[ChunkInput], ends: list[int]) -> list[int]:
    """Flat rows whose logits are wanted: for chunk ``i`` ending at flat row ``ends[i]``
    (exclusive), its last ``num_logits`` rows."""
    return [end - k for c, end in zip(chunks, ends) for k in range(c.num_logits, 0, -1)]


def long_tensor(values, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` for a list of Python ints, through NumPy: a
    step turns several lists of one int per running sequence into tensors, and NumPy converts
    256 ints in about a third of the time ``torch.tensor`` takes (each int is checked one by one
    there). A tensor passes through."""
    if isinstance(values, torch.Tensor):
        out = values.long()
    else:
        out = torch.from_numpy(np.array(values, dtype=np.int64))
    return out if device is None else out.to(device)
