"""Model runners: how a batch of sequences becomes forward passes.

Both runners expose the same three calls so the generation loop does not care which is used:

- ``start(seqs)``  — take a new batch;
- ``prefill()`` / ``decode()`` — logits ``[B, V]`` for the next token of each running row;
- ``release(seq)`` — a sequence finished; stop computing it.

``NaiveRunner`` recomputes every sequence from its first token at every step: O(n²) work, no
state, obviously correct. ``CachedRunner`` runs the prompt once (prefill), keeps every
layer's K/V in a preallocated ``ContiguousKVCache`` and then feeds one token per sequence per
step (decode). Both must produce identical greedy tokens — that is the first rung of the
correctness ladder.
"""

from __future__ import annotations

import torch

from minillm.kvcache import ContiguousKVCache
from minillm.models.llama import ForwardBatch, LlamaForCausalLM
from minillm.sequence import Sequence


def _padded(rows: list[list[int]], device: torch.device, pad: int = 0) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


class NaiveRunner:
    """No cache: each step is a full forward pass over every token of every running sequence."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.order: list[Sequence] = []

    def start(self, seqs: list[Sequence]) -> None:
        self.order = list(seqs)

    def _full_pass(self) -> torch.Tensor:
        ids = _padded([s.token_ids for s in self.order], self.device)
        positions = torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        last = torch.tensor([len(s) - 1 for s in self.order], device=self.device)
        return self.model(ForwardBatch(ids, positions, logit_index=last))

    prefill = decode = _full_pass

    def release(self, seq: Sequence) -> None:
        self.order.remove(seq)


class CachedRunner:
    """Prefill once, then one-token decode steps against a contiguous KV cache.

    Row ``i`` of the cache belongs to ``order[i]``. When a sequence finishes, the last row is
    moved into its place so the running rows stay ``0..B-1`` and every step reads plain views.
    """

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.order: list[Sequence] = []
        self.cache: ContiguousKVCache | None = None

    def start(self, seqs: list[Sequence]) -> None:
        self.order = list(seqs)
        max_len = max(len(s.prompt_token_ids) + s.max_output for s in seqs)
        self.cache = ContiguousKVCache(self.model.config, len(seqs), max_len, self.dtype, self.device)

    def prefill(self) -> torch.Tensor:
        prompts = [s.prompt_token_ids for s in self.order]
        ids = _padded(prompts, self.device)
        positions = torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        batch = ForwardBatch(ids, positions, self.cache, kv_len=ids.shape[1], logit_index=last, same_start=0)
        return self.model(batch)

    def decode(self) -> torch.Tensor:
        lengths = [len(s) for s in self.order]
        ids = torch.tensor([[s.output_token_ids[-1]] for s in self.order], device=self.device)
        positions = torch.tensor([[n - 1] for n in lengths], device=self.device)
        same = lengths[0] - 1 if min(lengths) == max(lengths) else None
        batch = ForwardBatch(ids, positions, self.cache, kv_len=max(lengths), same_start=same)
        return self.model.decode_step(batch)[:, -1]

    def release(self, seq: Sequence) -> None:
        row = self.order.index(seq)
        last = len(self.order) - 1
        if row != last:
            moved = self.order[last]
            self.cache.move_row(last, row, len(moved))
            self.order[row] = moved
        self.order.pop()
        if not self.order:
            self.cache = None  # free the slab as soon as the batch is done
