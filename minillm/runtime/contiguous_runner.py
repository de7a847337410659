"""The second rung: a contiguous KV cache per static batch (chapter 02).

The first step of a batch runs every prompt (prefill) and keeps every layer's K/V in a
preallocated ``ContiguousKVCache``, one row per sequence, long enough for the longest the
sequence may grow; later steps feed one token per sequence (decode). Row ``i`` belongs to
``order[i]``; when a sequence finishes, the last row moves into its place so the running rows
stay ``0..B-1`` and every step reads plain views.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

import minillm.hooks as hooks
from minillm.attention.contiguous import ForwardBatch
from minillm.kvcache import ContiguousKVCache
from minillm.models.llama import LlamaForCausalLM
from minillm.runtime.naive_runner import run_padded
from minillm.runtime.runner import StepInputs


class ContiguousRunner:
    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.order: list[Hashable] = []  # request id of each cache row
        self.lengths: list[int] = []
        self.cache: ContiguousKVCache | None = None

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if self.cache is None:
            return self._prefill(inputs)
        return self._decode(inputs)

    def _prefill(self, inputs: StepInputs) -> torch.Tensor:
        chunks = inputs.chunks
        if any(c.start != 0 for c in chunks):
            raise ValueError("a new contiguous batch must start with whole prompts (position 0)")
        self.order = [c.request_id for c in chunks]
        self.lengths = [c.num_tokens for c in chunks]  # tokens in each row's cache
        max_len = max(max(c.max_len, c.num_tokens) for c in chunks)
        # chapter 02's exercise plugs in here: the batch's cache object
        self.cache = hooks.contiguous_cache(self.model.config, len(chunks), max_len, self.dtype, self.device)
        width = max(c.num_tokens for c in chunks)
        return run_padded(self.model, inputs, cache=self.cache, kv_len=width, same_start=0)

    def _decode(self, inputs: StepInputs) -> torch.Tensor:
        chunks = inputs.chunks
        rows = {rid: i for i, rid in enumerate(self.order)}
        if sorted(rows.get(c.request_id, -1) for c in chunks) != list(range(len(self.order))):
            raise ValueError("a contiguous decode step must run every sequence of the batch, one token each")
        if any(c.num_tokens != 1 or c.num_logits != 1 for c in chunks):
            raise ValueError("after the prefill a contiguous batch decodes one token per sequence per step")
        by_row = sorted(chunks, key=lambda c: rows[c.request_id])
        lengths = self.lengths = [c.start + 1 for c in by_row]
        ids = torch.tensor([c.token_ids for c in by_row], device=self.device)
        positions = torch.tensor([[c.start] for c in by_row], device=self.device)
        same = lengths[0] - 1 if min(lengths) == max(lengths) else None
        batch = ForwardBatch(ids, positions, self.cache, kv_len=max(lengths), same_start=same)
        logits = self.model.decode_step(batch)[:, -1]  # in row order
        if any(a is not b for a, b in zip(by_row, chunks)):
            logits = logits[torch.tensor([rows[c.request_id] for c in chunks], device=self.device)]
        return logits

    def release(self, request_id: Hashable) -> None:
        if request_id not in self.order:
            return  # finished before its batch started (aborted while waiting)
        row = self.order.index(request_id)
        last = len(self.order) - 1
        if row != last:
            self.cache.move_row(last, row, self.lengths[last])
            self.order[row], self.lengths[row] = self.order[last], self.lengths[last]
        self.order.pop()
        self.lengths.pop()
        if not self.order:
            self.cache = None  # free the slab as soon as the batch is done
